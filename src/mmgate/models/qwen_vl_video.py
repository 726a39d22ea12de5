"""Qwen-VL video: planning, preprocessing and prompt layout (parameters and frame sampling:
:mod:`mmgate.models.qwen_vl_frames`).

Stage: plan / preprocess / expand of ``video_url`` parts for ``qwen2_vl``,
``qwen2_5_vl`` and ``qwen3_vl``.  In: a clip's header facts
(:class:`~mmgate.types.VideoMeta`) and per-item hints, then its decoded frames
(:class:`~mmgate.types.DecodedVideo`); out: frame indices, a
:class:`~mmgate.types.ItemPlan` (detail: a :class:`~mmgate.types.VideoDetail`), ``pixel_values`` rows and the replacement of
the template's ``<|video_pad|>``.

Reference (transformers 5.24), the class ``AutoProcessor`` builds per bundle:
* Qwen2-VL / Qwen2.5-VL: ``models/qwen2_vl/video_processing_qwen2_vl.py``
  ``Qwen2VLVideoProcessor``.  These bundles have no
  ``video_preprocessor_config.json``, so ``get_video_processor_dict`` falls back
  to ``preprocessor_config.json``: its ``min_pixels``/``max_pixels``, mean/std
  and patch sizes apply; everything else (``min_frames``, ``max_frames``,
  ``do_sample_frames=False``) is a class default.  Frames: by default as vLLM
  0.33's ``Qwen2VLVideoBackend`` samples them (2 fps through ``sample_frames``),
  or, under ``--video-frame-sampling transformers``, every frame as that class
  default says (:func:`mmgate.models.qwen_vl_frames.video_params`).
* Qwen3-VL: ``models/qwen3_vl/video_processing_qwen3_vl.py``
  ``Qwen3VLVideoProcessor`` from ``video_preprocessor_config.json`` (``fps=2``,
  sampling on, a ``longest_edge`` that bounds the pixels of *all* frames).
* Prompt: ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor.replace_video_token``
  (one run of ``t*h*w // merge**2`` pads; Qwen2.5-VL adds
  ``second_per_grid_ts = temporal_patch_size / sampled_fps``) and
  ``Qwen3VLProcessor.replace_video_token`` (per temporal patch
  ``<{t:.1f} seconds><|vision_start|>`` + ``h*w // merge**2`` pads +
  ``<|vision_end|>``, ``t`` from ``_calculate_timestamps``).

Placeholder anchoring: a clip's embedding range is its whole replacement.  For
Qwen2/2.5-VL that is the pad run; for Qwen3-VL it includes the timestamp text
and the per-frame vision markers, and the engine embeds only the positions
holding ``<|video_pad|>`` (vLLM ``PlaceholderRange.is_embed``; the SMG servicer
computes it from ``im_token_id``).  That is the content of vLLM's own Qwen3-VL
prompt update (``select_token_id(placeholder, video_token_id)``); unlike vLLM,
which replaces the template's outer markers too, the outer
``<|vision_start|>``/``<|vision_end|>`` stay, as in transformers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import numpy as np

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models import geometry
from mmgate.models.image_rows import RowSink
from mmgate.models.qwen_vl_frames import (
    QWEN3_VIDEO,
    QwenVLVideoParams,
    long_side_bound,
    qwen3_timestamps,
    sample_indices,
    smart_resize_qwen3,
)
from mmgate.models.qwen_vl_kwargs import TAKES_OPTIONS, check_options, frame_request, sized
from mmgate.models.video_pixels import FrameProcessor
from mmgate.models.backend import ImageBackend
from mmgate.types import (
    DecodedVideo,
    ItemHints,
    ItemPlan,
    Modality,
    Replacement,
    TensorLayout,
    TensorSpec,
    VideoDetail,
    VideoMeta,
)


class QwenVLVideo:
    """Video planning, preprocessing and expansion of one Qwen-VL bundle.

    ``encode(text)`` tokenizes one timestamp text (``<0.2 seconds>``); it is
    only called for Qwen3-VL.  A timestamp sits between two added special
    tokens (``<|vision_start|>``/``<|vision_end|>``), and the tokenizer splits on
    added tokens before anything else, so its ids are the same alone as in the
    reference's whole-prompt tokenization (tests/video/test_prompt_layout.py).
    """

    def __init__(self, model_type: str, params: QwenVLVideoParams, token_ids: Mapping[str, int],
                 encode: Callable[[str], list[int]], backend: ImageBackend) -> None:
        self.model_type = model_type
        self.p = params
        self.video_token_id = token_ids["<|video_pad|>"]
        self.vision_start_id = token_ids["<|vision_start|>"]
        self.vision_end_id = token_ids["<|vision_end|>"]
        self._encode = encode
        self.backend = backend
        # The video processors are torchvision-only: their fused rescale+normalize, whatever resizes.
        lut = geometry.normalize_lut(ImageBackend.TORCHVISION, params.rescale_factor, params.image_mean,
                                     params.image_std, params.do_rescale, params.do_normalize)
        self._pixels = FrameProcessor(backend, lut, params.rescale_factor, params.image_mean, params.image_std,
                                      params.do_rescale, params.do_normalize)
        self._timestamp_ids: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        specs = [TensorSpec("pixel_values", "float32", TensorLayout.FLAT, sizes_key="patches_per_video", primary=True),
                 TensorSpec("video_grid_thw", "int64", TensorLayout.BATCHED, keep_on_cpu=True),
                 TensorSpec("patches_per_video", "int64", TensorLayout.BATCHED)]
        if model_type == "qwen2_5_vl":
            specs.append(TensorSpec("second_per_grid_ts", "float32", TensorLayout.BATCHED))
        #: vLLM's layout (``qwen2_vl.py`` ``_create_qwen2vl_field_factory``; Qwen2.5-VL adds ``second_per_grid_ts``)
        self.specs: tuple[TensorSpec, ...] = tuple(specs)

    modality = Modality.VIDEO
    device_normalizable = True  # a worker may normalize the raw uint8 pixels itself (float32, as the reference)

    @property
    def anchor_token_id(self) -> int:
        return self.video_token_id

    @property
    def placeholder_token_id(self) -> int:
        return self.video_token_id

    @property
    def fingerprint(self) -> str:
        return f"qwen_vl_video:{self.model_type}:{self.backend.value}:{self.p!r}"

    def check_hints(self, hints: ItemHints, param: str) -> None:
        """Raises GatewayError(INVALID_REQUEST): ``max_long_side_pixel`` not a multiple of the resize
        factor; ``mm_processor_kwargs`` for Qwen3-VL, or ones Qwen2-VL / Qwen2.5-VL do not take or
        that conflict (:mod:`mmgate.models.qwen_vl_kwargs`)."""
        if hints.max_long_side_pixel is not None and hints.max_long_side_pixel % self.p.factor:
            raise GatewayError(ErrorCode.INVALID_REQUEST,
                               f"max_long_side_pixel must be a positive multiple of {self.p.factor}",
                               param + ".max_long_side_pixel")
        if hints.options:
            if self.model_type not in TAKES_OPTIONS:
                raise GatewayError(ErrorCode.INVALID_REQUEST, f"{self.model_type} takes no mm_processor_kwargs here",
                                   "mm_processor_kwargs")
            check_options(hints, self.model_type)
        frame_request(self.p, hints)

    def sample(self, meta: VideoMeta, hints: ItemHints) -> list[int]:
        return sample_indices(self.p, meta, hints)

    def _resized(self, p: QwenVLVideoParams, frames: int, height: int, width: int,
                 max_pixels: int) -> tuple[int, int]:
        """The reference's ``resize`` geometry for ``frames`` sampled frames (``cap_pixels_per_frame`` included),
        under ``p`` (the bundle's parameters with the request's pixel bounds)."""
        if p.processor == QWEN3_VIDEO:
            if p.cap_pixels_per_frame:
                per_frame = max(min(p.max_video_tokens * p.factor * p.factor, max_pixels // frames),
                                int(p.min_pixels * 1.05))
                max_pixels = per_frame * frames
            return smart_resize_qwen3(frames, height, width, p.temporal_patch_size, p.factor, p.min_pixels, max_pixels)
        if p.cap_pixels_per_frame:
            total = int(p.max_video_tokens * p.factor * p.factor * 0.9)
            max_pixels = max(min(max_pixels, total * p.temporal_patch_size // frames), int(p.min_pixels * 1.05))
        return geometry.smart_resize(height, width, p.factor, p.min_pixels, max_pixels)

    def max_pixels_for(self, frames: int, height: int, width: int, hints: ItemHints) -> int:
        """``size["longest_edge"]`` for this clip: the config's (or the request's ``max_pixels``), or the
        ``max_long_side_pixel`` hint's bound."""
        p = sized(self.p, hints)
        if hints.max_long_side_pixel is None or not p.do_resize:
            return p.max_pixels
        qwen3 = p.processor == QWEN3_VIDEO
        t_bar = round(frames / p.temporal_patch_size) * p.temporal_patch_size
        return long_side_bound(lambda bound: self._resized(p, frames, height, width, bound), height, width,
                               hints.max_long_side_pixel, p.max_pixels, frames if qwen3 else 1, t_bar if qwen3 else 1)

    def plan(self, video: DecodedVideo, hints: ItemHints) -> ItemPlan[VideoDetail]:
        """Geometry of one decoded clip (its actual frame size, its sampled frame count); ``detail.geometry``:
        ``(grid_t, grid_h, grid_w)``."""
        p = sized(self.p, hints)
        frames, height, width = len(video.frame_indices), video.height, video.width
        max_pixels = self.max_pixels_for(frames, height, width, hints)
        if p.do_resize:
            rh, rw = self._resized(p, frames, height, width, max_pixels)
        else:
            rh, rw = height, width
            if rh % p.factor or rw % p.factor:
                raise GatewayError(ErrorCode.INVALID_REQUEST, "video size is not a multiple of the patch grid")
        grid_t = -(-frames // p.temporal_patch_size)
        gh, gw = rh // p.patch_size, rw // p.patch_size
        shapes: tuple[tuple[str, tuple[int, ...]], ...] = (
            ("pixel_values", (grid_t * gh * gw, p.patch_dim)), ("video_grid_thw", (3,)), ("patches_per_video", ()))
        if len(self.specs) > 3:
            shapes += (("second_per_grid_ts", ()),)
        return ItemPlan(modality=Modality.VIDEO, original_hw=(height, width), resized_hw=(rh, rw),
                        num_tokens=grid_t * gh * gw // (p.merge_size**2), shapes=shapes,
                        detail=VideoDetail.sampled(video, (grid_t, gh, gw), max_pixels))

    def preprocess(self, video: DecodedVideo, plan: ItemPlan[VideoDetail], raw: bool = False) -> np.ndarray:
        """One clip -> ``[grid_t*grid_h*grid_w, C*T*P*P]`` rows, float32 (or raw uint8):
        :class:`~mmgate.models.video_pixels.FrameProcessor` (resize, pad time, patchify, normalize)."""
        p = self.p
        return self._pixels(video.frames, plan.resized_hw if p.do_resize else None, p.resample, p.patch_size,
                            p.merge_size, p.temporal_patch_size, raw)

    def write_rows(self, video: DecodedVideo, plan: ItemPlan[VideoDetail], raw: bool, sink: RowSink) -> int:
        """:meth:`preprocess`'s rows handed to ``sink(first_row, rows)`` one temporal patch at a time
        (:class:`~mmgate.models.family.VideoRowWriter`)."""
        p = self.p
        return self._pixels.write_rows(video.frames, plan.resized_hw if p.do_resize else None, p.resample,
                                       p.patch_size, p.merge_size, p.temporal_patch_size, raw, sink)

    def plan_tensors(self, plan: ItemPlan[VideoDetail]) -> dict[str, np.ndarray]:
        """``video_grid_thw`` ``[3]`` and ``patches_per_video`` int64 of one clip, and for Qwen2.5-VL
        ``second_per_grid_ts`` (``Qwen2_5_VLProcessor._process_videos``: temporal_patch_size /
        sampled_fps, float32 there)."""
        out = {"video_grid_thw": np.array(plan.detail.geometry, dtype=np.int64),
               "patches_per_video": np.array(plan.primary_shape[0], dtype=np.int64)}
        if len(self.specs) > 3:
            out["second_per_grid_ts"] = np.array(self.p.temporal_patch_size / plan.detail.sampled_fps,
                                                  dtype=np.float32)
        return out

    def _timestamp(self, seconds: float) -> tuple[int, ...]:
        text = f"<{seconds:.1f} seconds>"
        ids = self._timestamp_ids.get(text)
        if ids is None:
            ids = tuple(self._encode(text))
            with self._lock:
                if len(self._timestamp_ids) < 65536:
                    self._timestamp_ids[text] = ids
        return ids

    def expand(self, plan: ItemPlan[VideoDetail]) -> Replacement:
        """What replaces one ``<|video_pad|>``; the embedding range is the whole replacement."""
        grid_t, gh, gw = plan.detail.geometry
        if self.p.processor != QWEN3_VIDEO:
            ids: tuple[int, ...] = (self.video_token_id,) * plan.num_tokens
        else:
            frame = (self.vision_start_id,) + (self.video_token_id,) * (gh * gw // self.p.merge_size**2) + (
                self.vision_end_id,)
            stamps = qwen3_timestamps(plan.detail.frame_indices, plan.detail.source_fps, self.p.temporal_patch_size)
            ids = tuple(t for s in stamps[:grid_t] for t in self._timestamp(s) + frame)
        return Replacement(token_ids=ids, embed_offset=0, embed_length=len(ids))
