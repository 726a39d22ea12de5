"""Qwen-VL video before decoding: parameters, frame sampling, timestamps and frame geometry.

Stage: plan (video).  In: the bundle's processor configs, the gateway's
``--video-frame-sampling`` and a clip's header facts (:class:`~mmgate.types.VideoMeta`) with
per-item hints; out: the resolved :class:`QwenVLVideoParams`, the frame indices to decode,
Qwen3-VL timestamps and resized frame sizes.  :mod:`mmgate.models.qwen_vl_video` uses these to
plan, preprocess and lay out the prompt (references there); the request's kwargs resolve in
:mod:`mmgate.models.qwen_vl_kwargs`.

Reference (transformers 5.24): ``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor``
``sample_frames`` and ``_preprocess`` (``smart_resize``), ``Qwen3VLProcessor._calculate_timestamps``.
Where a Qwen2-VL / Qwen2.5-VL bundle does not set ``do_sample_frames`` and the gateway follows
vLLM (the default): vLLM 0.33 ``vllm/multimodal/video.py`` ``Qwen2VLVideoBackend``
(``load_bytes`` ``fps=2``; ``compute_frames_index_to_sample``: the transformers fps path, its
out-of-range tail index clamped to the last frame).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models import geometry
from mmgate.models.qwen_vl_kwargs import FrameRequest, frame_request
from mmgate.models.backend import FrameSampling
from mmgate.types import ItemHints, VideoMeta

QWEN2_VIDEO = "Qwen2VLVideoProcessor"
QWEN3_VIDEO = "Qwen3VLVideoProcessor"
_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
#: transformers 5.24 class attributes of the two video processors
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    QWEN2_VIDEO: {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, "image_mean": _CLIP[0],
                  "image_std": _CLIP[1], "patch_size": 14, "do_sample_frames": False, "fps": None,
                  "max_video_tokens": 128000},
    QWEN3_VIDEO: {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "image_mean": (0.5,) * 3,
                  "image_std": (0.5,) * 3, "patch_size": 16, "do_sample_frames": True, "fps": 2,
                  "max_video_tokens": 768},
}
_PROCESSOR_BY_MODEL_TYPE = {"qwen2_vl": QWEN2_VIDEO, "qwen2_5_vl": QWEN2_VIDEO, "qwen3_vl": QWEN3_VIDEO}
#: frames per second a vLLM worker samples Qwen2-VL / Qwen2.5-VL clips at (vLLM 0.33
#: ``vllm/multimodal/video.py`` ``Qwen2VLVideoBackend.load_bytes`` ``fps=2``; the same rate as
#: qwen-vl-utils' ``FPS``)
VLLM_QWEN2_FPS = 2.0


@dataclass(frozen=True, slots=True)
class QwenVLVideoParams(geometry.PatchGeometry):
    """Every video-preprocessing parameter, as the reference video processor resolves it."""

    processor: str  # QWEN2_VIDEO or QWEN3_VIDEO: which sampling and smart_resize apply
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int  # size["shortest_edge"]
    max_pixels: int  # size["longest_edge"] (Qwen3: of all frames together)
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_resize: bool
    do_rescale: bool
    do_normalize: bool
    resample: int
    do_sample_frames: bool
    fps: float | None  # frames per second sampled when do_sample_frames
    num_frames: int | None
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool  # the reference's ``None`` (warn, then off) reads as False
    max_video_tokens: int
    #: ``fps`` is vLLM's loader rate, not the bundle's (``--video-frame-sampling vllm`` on a bundle that does
    #: not set ``do_sample_frames``): a request's ``num_frames`` replaces it.  Out of the repr (and so of the
    #: fingerprint): it changes no output, only which requests are refused.
    vllm_rate: bool = field(default=False, repr=False)


def video_config(bundle_processor: Mapping[str, Any], video: Mapping[str, Any], image: Mapping[str, Any]) -> dict:
    """The dict the reference builds its video processor from (``get_video_processor_dict``, 5.24):
    ``processor_config.json["video_processor"]``, else ``video_preprocessor_config.json``, else
    ``preprocessor_config.json``."""
    nested = bundle_processor.get("video_processor")
    if isinstance(nested, dict):
        return dict(nested)
    return dict(video or image)


def video_params(model_type: str, cfg: Mapping[str, Any],
                 sampling: FrameSampling = FrameSampling.VLLM) -> QwenVLVideoParams:
    """Resolve like the processor's ``__init__``: class defaults, then the config; ``Qwen2VLVideoProcessor``
    also takes ``min_pixels``/``max_pixels`` over ``size``.

    ``sampling`` ``vllm``: a ``Qwen2VLVideoProcessor`` config without ``do_sample_frames`` samples as
    vLLM's ``Qwen2VLVideoBackend`` does, ``do_sample_frames=True, fps=2, num_frames=None`` (vLLM reads
    neither of the bundle's; ``min_frames``, ``max_frames`` and ``temporal_patch_size`` stay the
    bundle's, which are vLLM's 4, 768 and 2 in every shipped bundle).  A config that sets
    ``do_sample_frames`` is followed as it says, under either setting."""
    processor = str(cfg.get("video_processor_type") or _PROCESSOR_BY_MODEL_TYPE[model_type]).removesuffix("Fast")
    if processor not in _CLASS_DEFAULTS:
        processor = _PROCESSOR_BY_MODEL_TYPE[model_type]
    d = _CLASS_DEFAULTS[processor]
    size = dict(cfg.get("size") or d["size"])
    if processor == QWEN2_VIDEO:
        if cfg.get("min_pixels") is not None:
            size["shortest_edge"] = cfg["min_pixels"]
        if cfg.get("max_pixels") is not None:
            size["longest_edge"] = cfg["max_pixels"]
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, "video processor size needs shortest_edge and longest_edge")
    fps = cfg.get("fps", d["fps"])
    num_frames = cfg.get("num_frames")
    do_sample = cfg.get("do_sample_frames")
    vllm_rate = processor == QWEN2_VIDEO and sampling is FrameSampling.VLLM and do_sample is None
    if vllm_rate:
        do_sample, fps, num_frames = True, VLLM_QWEN2_FPS, None
    return QwenVLVideoParams(
        processor=processor,
        patch_size=int(cfg.get("patch_size", d["patch_size"])),
        merge_size=int(cfg.get("merge_size", 2)),
        temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
        min_pixels=int(size["shortest_edge"]),
        max_pixels=int(size["longest_edge"]),
        image_mean=tuple(float(v) for v in cfg.get("image_mean", d["image_mean"])),
        image_std=tuple(float(v) for v in cfg.get("image_std", d["image_std"])),
        rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
        do_resize=bool(cfg.get("do_resize", True)),
        do_rescale=bool(cfg.get("do_rescale", True)),
        do_normalize=bool(cfg.get("do_normalize", True)),
        resample=int(cfg.get("resample", geometry.RESAMPLE_BICUBIC)),
        do_sample_frames=bool(d["do_sample_frames"] if do_sample is None else do_sample),
        fps=None if fps is None else float(fps),
        num_frames=None if num_frames is None else int(num_frames),
        min_frames=int(cfg.get("min_frames", 4)),
        max_frames=int(cfg.get("max_frames", 768)),
        cap_pixels_per_frame=bool(cfg.get("cap_pixels_per_frame") or False),
        max_video_tokens=int(cfg.get("max_video_tokens", d["max_video_tokens"])),
        vllm_rate=vllm_rate,
    )


# ---------------------------------------------------------------- frame sampling


def _unsampleable(message: str) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message)


def torch_arange_int(total: int, num_frames: int) -> list[int]:
    """``torch.arange(0, total, total / num_frames).int()``, the reference's index arithmetic, without torch.

    ATen ``RangeFactoriesKernel.cpp`` ``arange_kernel`` (torch 2.14.1) computes in the
    accumulate type of float32 on CPU, float64: ``cpu_serial_kernel_vec`` fills pairs of
    ``Vectorized<float>`` blocks, lane ``k`` of the block at ``i0`` being
    ``float32(float32(start + step * i0) + k * step)`` (``Vectorized<float>::arange``,
    the sum in float64), and the scalar tail ``float32(start + step * i)``; ``.int()``
    truncates.  The low bits depend on the block width: 8 lanes, measured equal to torch
    on x86 with CPU capability AVX2, AVX512 (this kernel runs 8 lanes there too) and
    DEFAULT (``tests/video/test_sampling_rules.py``).  torch builds whose NEON
    ``Vectorized<float>`` has 4 lanes and a float32 ``fmadd`` (aarch64) may differ in the
    last bit on long clips; that layout is not modelled.
    """
    return _arange_8_lanes(total, num_frames)


def _arange_8_lanes(total: int, num_frames: int, lanes: int = 8) -> list[int]:
    step = total / num_frames
    size = math.ceil(total / step)
    vectorized = size - size % (2 * lanes)  # cpu_serial_kernel_vec: pairs of vectors, then a scalar tail
    out = []
    for i in range(size):
        if i < vectorized:
            base = float(np.float32(step * (i - i % lanes)))
            out.append(int(np.float32(base + (i % lanes) * step)))
        else:
            out.append(int(np.float32(step * i)))
    return out


def sample_qwen2(p: QwenVLVideoParams, meta: VideoMeta, r: FrameRequest) -> list[int]:
    """transformers 5.24 ``Qwen2VLVideoProcessor.sample_frames`` (same operations, same order), with the
    tail of vLLM 0.33 ``Qwen2VLVideoBackend.compute_frames_index_to_sample``.

    * ``num_frames``: rounded to a multiple of ``temporal_patch_size``;
    * else ``fps``: ``min(max(total / video_fps * fps, min_frames), floor(min(max_frames, total) / tps) * tps,
      total)``, floored to a multiple of ``tps``;
    * else every frame;
    * indices ``torch.arange(0, total, total / n).int()``.  Where float rounding makes that yield one
      value more, equal to ``total`` (transformers then fails with ``IndexError`` on the frames), it is
      clamped to ``total - 1``, as vLLM does: ``n + 1`` distinct frames.
    * A clip too short for the fps path (fewer frames than ``tps``: ``n`` floors to 0, where both
      references divide by zero) keeps every frame, as the transformers default processes it
      (docs/video.md).

    Raises:
        GatewayError(INVALID_REQUEST): ``num_frames`` above the clip's frames or rounding to 0 (the reference
            raises ``ValueError`` / divides by zero); a request's ``min_frames`` / ``max_frames`` that leave
            no frame of a clip long enough to sample.
    """
    total, tps = meta.total_frames, p.temporal_patch_size
    if r.num_frames is not None:
        num_frames = round(r.num_frames / tps) * tps
        if num_frames > total:
            raise _unsampleable(f"the video has {total} frame(s): num_frames={num_frames} exceeds them")
        if num_frames <= 0:
            raise _unsampleable(f"num_frames={r.num_frames} rounds to no frame (a multiple of {tps} is sampled)")
    elif r.fps is not None:
        max_frames = math.floor(min(r.max_frames, total) / tps) * tps
        wanted = total / meta.fps * r.fps
        wanted = min(max(wanted, r.min_frames), max_frames, total)
        num_frames = math.floor(wanted / tps) * tps
        if num_frames <= 0:
            if total < tps:
                return list(range(total))
            raise _unsampleable(f"min_frames / max_frames leave no frame to sample (a multiple of {tps} is sampled)")
    else:
        return list(range(total))
    return [min(i, total - 1) for i in torch_arange_int(total, num_frames)]


def sample_qwen3(p: QwenVLVideoParams, meta: VideoMeta, fps: float | None, num_frames: int | None) -> list[int]:
    """transformers 5.24 ``Qwen3VLVideoProcessor.sample_frames``: ``np.linspace(0, total - 1, n).round()``."""
    total = meta.total_frames
    if num_frames is None and fps is not None:
        num_frames = int(total / meta.fps * fps)
        num_frames = min(max(num_frames, p.min_frames), p.max_frames, total)
    if num_frames is None:
        num_frames = min(max(total, p.min_frames), p.max_frames)
    return [int(i) for i in np.linspace(0, total - 1, num_frames).round().astype(int)]


def sample_indices(p: QwenVLVideoParams, meta: VideoMeta, hints: ItemHints) -> list[int]:
    """The stream frame indices the reference keeps, for the arguments in force
    (:func:`mmgate.models.qwen_vl_kwargs.frame_request`): no sampling, every frame.

    Raises:
        GatewayError(INVALID_REQUEST): a clip the arguments cannot sample, conflicting arguments;
        GatewayError(INTERNAL_ERROR): a config with both ``fps`` and ``num_frames``.
    """
    r = frame_request(p, hints)
    if not r.do_sample_frames:
        return list(range(meta.total_frames))
    if p.processor == QWEN3_VIDEO:
        return sample_qwen3(p, meta, r.fps, r.num_frames)
    return sample_qwen2(p, meta, r)


def qwen3_timestamps(indices: Sequence[int], video_fps: float, temporal_patch_size: int) -> list[float]:
    """transformers 5.24 ``Qwen3VLProcessor._calculate_timestamps``: one per temporal patch, the mean
    of its first and last frame time (the last patch padded with the last index)."""
    idx = list(indices)
    if len(idx) % temporal_patch_size:
        idx.extend(idx[-1] for _ in range(temporal_patch_size - len(idx) % temporal_patch_size))
    times = [i / video_fps for i in idx]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


# ---------------------------------------------------------------- geometry


def smart_resize_qwen3(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers 5.24 ``models/qwen3_vl/video_processing_qwen3_vl.py`` ``smart_resize``: the pixel
    bounds count every frame (``t_bar * h_bar * w_bar``); sides below ``factor`` are scaled up first.

    Raises:
        GatewayError(INVALID_REQUEST): fewer frames than ``temporal_factor`` (the reference raises).
        GatewayError(IMAGE_ASPECT_RATIO_INVALID): ratio above 200.
    """
    if num_frames < temporal_factor:
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           f"the video yields {num_frames} frame(s); this model needs at least {temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > geometry.MAX_ASPECT_RATIO:
        raise GatewayError(ErrorCode.IMAGE_ASPECT_RATIO_INVALID,
                           f"absolute aspect ratio must be smaller than {geometry.MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def long_side_bound(resize: Callable[[int], tuple[int, int]], height: int, width: int, long_side: int,
                    max_pixels: int, frames: int = 1, weight: int = 1) -> int:
    """The ``size["longest_edge"]`` a ``max_long_side_pixel`` hint maps to, for one item (docs/video.md).

    ``A = min(max_pixels, floor(L*L*short*frames / long))``: with it, the
    shrinking branch of ``smart_resize`` gives a long side of at most ``L``.
    Where rounding to the factor grid keeps the item unshrunk with a long side
    above ``L``, ``A`` drops to one below the area smart_resize compared
    (``weight`` = ``t_bar`` for Qwen3-VL clips), which makes it shrink.  The
    min_pixels floor still wins for items it enlarges.

    ``resize(bound)`` -> resized (h, w) under ``size["longest_edge"] = bound``.
    """
    short, long = min(height, width), max(height, width)
    bound = min(max_pixels, long_side * long_side * short * frames // long)
    rh, rw = resize(bound)
    if max(rh, rw) > long_side and weight * rh * rw - 1 < bound:
        bound = weight * rh * rw - 1
    return max(bound, 1)


# ---------------------------------------------------------------- the video side of the family
