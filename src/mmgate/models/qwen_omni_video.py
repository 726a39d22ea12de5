"""Qwen Omni videos: the Qwen-VL clip path with the Omni processors' size, token and ``video_second_per_grid``.

Stage: sample / plan / preprocess / expand (video) for ``qwen2_5_omni`` and ``qwen3_omni_moe``.

Reference (transformers 5.24): both bundles build ``Qwen2VLVideoProcessor`` from
``preprocessor_config.json`` (patch 14 / 16, the bundle's mean/std, ``do_sample_frames`` unset, so every
frame given is kept), and the processor calls it with its own class default ``videos_kwargs``
``size``, which replaces the config's bounds (checked: a 1280x960 clip gets grid 48x64 through the
processor, 68x92 / 60x80 through the video processor alone):

* ``Qwen2_5OmniProcessor.videos_kwargs`` ``{"shortest_edge": 128*28*28, "longest_edge": 768*28*28}``;
* ``Qwen3OmniMoeProcessor.videos_kwargs`` ``{"shortest_edge": 128*32*32, "longest_edge": 768*32*32}``.

``_process_videos`` adds ``video_second_per_grid = temporal_patch_size / fps`` with ``fps`` the
``videos_kwargs["fps"]`` it is called with or its hard-coded default (Qwen2.5-Omni 2.0, Qwen3-Omni 1.0).
mmgate takes no ``fps`` option for these models: under ``--video-frame-sampling vllm`` the clip is sampled
at 2 fps and the value is the processor's for ``fps=2`` (as a vLLM worker calls it: ``do_sample_frames=True,
fps=2``), i.e. 1.0 for both; under ``transformers`` (every frame, no fps) the default's (1.0 / 2.0); float32.  ``replace_video_token`` repeats the video token ``t*h*w // merge**2`` times (no timestamps;
``<|vision_bos|>``/``<|vision_start|>`` and the end token come from the template).  Frames are chosen
as for Qwen2.5-VL (``--video-frame-sampling``: vLLM's 2 fps by default; ``transformers``: every frame).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.models.qwen_vl_frames import QWEN2_VIDEO, video_params
from mmgate.models.qwen_vl_kwargs import frame_request
from mmgate.models.qwen_vl_video import QwenVLVideo
from mmgate.types import DecodedVideo, ItemHints, ItemPlan, TensorLayout, TensorSpec, VideoDetail

#: the processors' class-default ``videos_kwargs["size"]`` (transformers 5.24)
PROCESSOR_VIDEO_SIZE: dict[str, dict[str, int]] = {
    "qwen2_5_omni": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
    "qwen3_omni_moe": {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32},
}
#: ``_process_videos``' fps when the request gives none
PROCESSOR_DEFAULT_FPS: dict[str, float] = {"qwen2_5_omni": 2.0, "qwen3_omni_moe": 1.0}
_BASE_SPECS = 3  # pixel_values, video_grid_thw, patches_per_video (QwenVLVideo's)


def omni_video_config(model_type: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The video processor's settings as the Omni processor runs it: the bundle's config with the
    processor's ``size`` in place of its pixel bounds."""
    out = {k: v for k, v in cfg.items() if k not in ("min_pixels", "max_pixels", "size")}
    out["video_processor_type"] = QWEN2_VIDEO
    out["size"] = dict(PROCESSOR_VIDEO_SIZE[model_type])
    return out


class OmniVideo(QwenVLVideo):
    """:class:`~mmgate.models.qwen_vl_video.QwenVLVideo` with Omni's tokens, options and ``video_second_per_grid``."""

    def __init__(self, model_type: str, cfg: Mapping[str, Any], token_ids: Mapping[str, int],
                 encode: Callable[[str], list[int]], backend: ImageBackend, sampling: FrameSampling,
                 check_options: Callable[[ItemHints, str], None]) -> None:
        params = video_params("qwen2_vl", omni_video_config(model_type, cfg), sampling)
        super().__init__("qwen2_vl", params, token_ids, encode, backend)
        self.model_type = model_type  # after the base: its Qwen2-VL branches stay off (no second_per_grid_ts)
        #: the fps the processor is called with: the sampling rate where frames are sampled at one (vLLM's 2 fps, as
        #: a vLLM worker passes it), else the processor's default
        fps = params.fps if params.do_sample_frames and params.fps else PROCESSOR_DEFAULT_FPS[model_type]
        self.second_per_grid = float(np.float32(params.temporal_patch_size / fps))
        self._check_options = check_options
        self.specs = (*self.specs[:_BASE_SPECS], TensorSpec("video_second_per_grid", "float32", TensorLayout.BATCHED))

    @property
    def fingerprint(self) -> str:
        return f"qwen_omni_video:{self.model_type}:{self.backend.value}:{self.p!r}"

    def check_hints(self, hints: ItemHints, param: str) -> None:
        """Raises GatewayError(INVALID_REQUEST): ``max_long_side_pixel`` off the resize factor, options other
        than ``use_audio_in_video: false``, a ``fps`` hint the sampling refuses."""
        if hints.max_long_side_pixel is not None and hints.max_long_side_pixel % self.p.factor:
            raise GatewayError(ErrorCode.INVALID_REQUEST,
                               f"max_long_side_pixel must be a positive multiple of {self.p.factor}",
                               param + ".max_long_side_pixel")
        self._check_options(hints, self.model_type)
        frame_request(self.p, hints)

    def plan(self, video: DecodedVideo, hints: ItemHints) -> ItemPlan[VideoDetail]:
        plan = super().plan(video, hints)
        return dataclasses.replace(plan, shapes=(*plan.shapes[:_BASE_SPECS], ("video_second_per_grid", ())))

    def plan_tensors(self, plan: ItemPlan[VideoDetail]) -> dict[str, np.ndarray]:
        out = {k: v for k, v in super().plan_tensors(plan).items() if k != "second_per_grid_ts"}
        out["video_second_per_grid"] = np.array(self.second_per_grid, dtype=np.float32)
        return out
