"""Qwen2-VL / Qwen2.5-VL per-request processor kwargs: the names a request's ``mm_processor_kwargs``
may hold, and what they resolve to for one item.

Stage: plan (checked before any fetch: ``QwenVLImage.check_hints``, ``QwenVLVideo.check_hints``),
then sample and plan (applied per item).  In: the bundle's resolved parameters and the item's
:class:`~mmgate.types.ItemHints`; out: the parameters with the request's pixel bounds
(:func:`sized`) and the frame-sampling arguments in force for a clip (:func:`frame_request`).

Reference (transformers 5.24), the processor a vLLM worker calls with ``mm_processor_kwargs``:

* ``Qwen2VLProcessor.__call__`` (``ProcessorMixin._merge_kwargs``) hands a flat kwarg to every
  modality whose kwargs declare it: ``min_pixels`` / ``max_pixels`` to ``Qwen2VLImageProcessor``
  *and* ``Qwen2VLVideoProcessor`` (both ``_standardize_kwargs``: they replace
  ``size["shortest_edge"]`` / ``size["longest_edge"]``, the other bound stays the bundle's), the
  sampling ones (``VideosKwargs``, ``Qwen2VLVideoProcessorInitKwargs``) to the video processor
  only, so an image-only request ignores them.
* ``BaseVideoProcessor.preprocess`` fills every kwarg not passed from the instance, then calls
  ``Qwen2VLVideoProcessor.sample_frames(metadata, **kwargs)`` when ``do_sample_frames``:
  ``fps`` and ``num_frames`` together raise ``ValueError`` (mutually exclusive), the instance's
  ``fps`` included; ``do_sample_frames=True`` with neither raises ``TypeError``.  Both are 400s
  here.  ``fps`` without ``do_sample_frames`` is ignored where the processor does not sample
  (the transformers default of these bundles).

Under ``--video-frame-sampling vllm`` a bundle that does not set ``do_sample_frames`` samples
at vLLM's loader rate (:data:`mmgate.models.qwen_vl_frames.VLLM_QWEN2_FPS`); that rate is not a
processor setting, so a request's ``num_frames`` replaces it instead of colliding with it.

Gateway bounds (the reference has none): ``fps`` above 0; ``num_frames``, ``min_frames`` and
``max_frames`` at least 1; ``min_pixels`` / ``max_pixels`` within [1, :data:`MAX_REQUEST_PIXELS`].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol, TypeVar

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.processor_options import check_option_types, option_error
from mmgate.types import ItemHints

#: model types whose processor kwargs are taken per request (Qwen3-VL takes none here)
TAKES_OPTIONS = ("qwen2_vl", "qwen2_5_vl")
#: ``mm_processor_kwargs`` names -> accepted Python types (``Qwen2VLVideoProcessorInitKwargs``,
#: ``VideosKwargs``, ``Qwen2VLImageProcessorKwargs``)
OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "do_sample_frames": (bool,),
    "fps": (float, int),
    "num_frames": (int,),
    "min_frames": (int,),
    "max_frames": (int,),
    "min_pixels": (int,),
    "max_pixels": (int,),
}
#: gateway bound on a request's ``min_pixels`` / ``max_pixels``: 16384 merged patches of 28x28 px, the
#: ``max_pixels`` of the shipped Qwen2-VL / Qwen2.5-VL image configs (a large image gets it already), so a
#: request's ``min_pixels`` cannot make each small item a larger tensor than that
MAX_REQUEST_PIXELS = 16384 * 28 * 28


@dataclass(frozen=True, slots=True)
class FrameRequest:
    """The ``sample_frames`` arguments in force for one clip: the bundle's (or vLLM's rate), then the request's."""

    do_sample_frames: bool
    fps: float | None  # frames per second to sample
    num_frames: int | None  # frames to sample (rounded to a multiple of temporal_patch_size)
    min_frames: int
    max_frames: int


def check_options(hints: ItemHints, model_type: str) -> None:
    """Names, types and gateway bounds of a Qwen2-VL / Qwen2.5-VL request's ``mm_processor_kwargs``.

    Raises:
        GatewayError(INVALID_REQUEST): a name not in :data:`OPTION_TYPES`, a wrong type, a value
            out of bounds (``param = "mm_processor_kwargs.<name>"``).
    """
    check_option_types(hints, OPTION_TYPES, model_type)
    for name, value in hints.options:
        number = float(value) if isinstance(value, (int, float)) else 0.0  # every option here is a number or a bool
        if name == "fps" and not number > 0:
            raise option_error(name, "fps must be above 0")
        if name in ("num_frames", "min_frames", "max_frames") and not number >= 1:
            raise option_error(name, f"{name} must be at least 1")
        if name in ("min_pixels", "max_pixels") and not 1 <= number <= MAX_REQUEST_PIXELS:
            raise option_error(name, f"{name} must be within [1, {MAX_REQUEST_PIXELS}]")


class _Sized(Protocol):
    @property
    def min_pixels(self) -> int: ...

    @property
    def max_pixels(self) -> int: ...


S = TypeVar("S", bound=_Sized)


def sized(params: S, hints: ItemHints | None) -> S:
    """``params`` with the request's ``min_pixels`` / ``max_pixels`` as ``size["shortest_edge"]`` /
    ``size["longest_edge"]`` (``_standardize_kwargs``); ``params`` itself when neither is set."""
    if hints is None or not hints.options:
        return params
    low, high = hints.option("min_pixels"), hints.option("max_pixels")
    if low is None and high is None:
        return params
    bounds = {"min_pixels": params.min_pixels if low is None else int(low),
              "max_pixels": params.max_pixels if high is None else int(high)}
    return dataclasses.replace(params, **bounds)  # type: ignore[type-var]


def _exclusive(name: str) -> GatewayError:
    return option_error(name, "`num_frames` and `fps` are mutually exclusive arguments, please use only one!")


class _FrameDefaults(Protocol):
    """The sampling defaults :func:`frame_request` reads (``mmgate.models.qwen_vl_frames.QwenVLVideoParams``)."""

    @property
    def do_sample_frames(self) -> bool: ...

    @property
    def fps(self) -> float | None: ...

    @property
    def num_frames(self) -> int | None: ...

    @property
    def min_frames(self) -> int: ...

    @property
    def max_frames(self) -> int: ...

    @property
    def vllm_rate(self) -> bool: ...


def frame_request(p: _FrameDefaults, hints: ItemHints) -> FrameRequest:
    """The sampling arguments for one clip, as ``preprocess`` hands them to ``sample_frames``.

    The bundle's settings (or, with ``p.vllm_rate``, vLLM's rate), then the request's
    ``mm_processor_kwargs``, then the item's ``video_url.fps`` hint (``do_sample_frames=True,
    fps=F, num_frames=None``; docs/video.md, "Hints").

    Raises:
        GatewayError(INVALID_REQUEST): ``fps`` and ``num_frames`` both in force, one of them the
            request's; ``do_sample_frames`` requested with neither.
        GatewayError(INTERNAL_ERROR): a bundle config that sets both.
    """
    fps, num = p.fps, p.num_frames
    asked_fps, asked_num = hints.option("fps"), hints.option("num_frames")
    if asked_fps is not None and asked_num is not None:
        raise _exclusive("num_frames")
    do_sample = bool(hints.option("do_sample_frames", p.do_sample_frames))
    if asked_fps is not None:
        fps, num = float(asked_fps), None if p.vllm_rate else num
    if asked_num is not None:
        fps, num = None if p.vllm_rate else fps, int(asked_num)
    if hints.fps is not None:
        if asked_num is not None:
            raise _exclusive("num_frames")
        do_sample, fps, num = True, hints.fps, None
    if do_sample and fps is not None and num is not None:
        if asked_fps is not None or asked_num is not None:
            raise _exclusive("num_frames" if asked_num is not None else "fps")
        raise GatewayError(ErrorCode.INTERNAL_ERROR, "video processor config sets both fps and num_frames")
    if do_sample and fps is None and num is None and hints.option("do_sample_frames") is not None:
        raise option_error("do_sample_frames", "do_sample_frames needs fps or num_frames (the processor sets "
                           "neither)")
    return FrameRequest(do_sample_frames=do_sample, fps=fps, num_frames=num,
                        min_frames=int(hints.option("min_frames", p.min_frames)),  # type: ignore[arg-type]
                        max_frames=int(hints.option("max_frames", p.max_frames)))  # type: ignore[arg-type]
