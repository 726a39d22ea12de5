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

``use_audio_in_video`` (``mm_processor_kwargs``; the processors' deprecated name of ``load_audio_from_video``):
the clip's audio track is decoded as an audio part (:class:`~mmgate.models.family.AudioTrackVideo`; its features
are the family's audio item, a companion of the clip) and ``replace_video_with_audio_token`` replaces the anchor
with ``<audio start> (video and audio pad tokens interleaved) <audio end>`` (the template's vision start/end stay
around it).  The interleaving orders each token by its time position: video tokens of temporal patch ``t`` at
``t * video_second_per_grid * position_id_per_seconds``, audio token ``k`` at ``k``:

* Qwen2.5-Omni (``position_id_per_seconds`` 25, ``seconds_per_chunk`` 2.0): both sequences cut by
  ``get_chunked_index`` into chunks of 50 positions, then video chunk ``j``, audio chunk ``j``, ...
  (:func:`qwen2_5_omni_interleave`);
* Qwen3-Omni (``position_id_per_seconds`` 13): merged token by token, a video token first on a tie
  (:func:`qwen3_omni_interleave`).

A clip without an audio stream keeps its plain run (``video_to_audio_indices`` None for it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.models.qwen_vl_frames import QWEN2_VIDEO, video_params
from mmgate.models.qwen_vl_kwargs import frame_request
from mmgate.models.qwen_vl_video import QwenVLVideo
from mmgate.types import DecodedVideo, ItemHints, ItemPlan, Replacement, TensorLayout, TensorSpec, VideoDetail

#: the processors' class-default ``videos_kwargs["size"]`` (transformers 5.24)
PROCESSOR_VIDEO_SIZE: dict[str, dict[str, int]] = {
    "qwen2_5_omni": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
    "qwen3_omni_moe": {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32},
}
#: ``_process_videos``' fps when the request gives none
PROCESSOR_DEFAULT_FPS: dict[str, float] = {"qwen2_5_omni": 2.0, "qwen3_omni_moe": 1.0}
_BASE_SPECS = 3  # pixel_values, video_grid_thw, patches_per_video (QwenVLVideo's)
#: the processors' class attributes ``position_id_per_seconds`` and ``seconds_per_chunk`` (transformers 5.24;
#: the bundles' ``thinker_config`` has the same values, which vLLM reads)
POSITION_ID_PER_SECONDS: dict[str, float] = {"qwen2_5_omni": 25, "qwen3_omni_moe": 13.0}
SECONDS_PER_CHUNK = 2.0

#: a run of one token: (token id, count)
Run = tuple[int, int]


def chunk_bounds(values: Sequence[float], counts: Sequence[int], per_chunk: int) -> list[tuple[int, int]]:
    """``Qwen2_5OmniProcessor.get_chunked_index`` (transformers 5.24) on a sequence given as runs of equal values
    (``values[k]`` repeated ``counts[k]`` times): ``(start, end)`` of each chunk, a new one at every element whose
    value reaches the next multiple of ``per_chunk`` (one multiple per element, as there: a value past several
    multiples opens one chunk on each of its next elements)."""
    out: list[tuple[int, int]] = []
    start, current, pos = 0, 1, 0
    for value, count in zip(values, counts):
        k = 0
        while k < count and value >= current * per_chunk:
            out.append((start, pos + k))
            start, current = pos + k, current + 1
            k += 1
        pos += count
    out.append((start, pos))
    return out


def qwen2_5_omni_interleave(grid_t: int, frame_tokens: int, second_per_grid: float, audio_tokens: int,
                            video_id: int, audio_id: int) -> list[Run]:
    """``Qwen2_5OmniProcessor.replace_video_with_audio_token`` without the start/end tokens, as runs."""
    per_second = POSITION_ID_PER_SECONDS["qwen2_5_omni"]
    per_chunk = int(per_second * SECONDS_PER_CHUNK)
    video = chunk_bounds((np.arange(grid_t) * second_per_grid * per_second).tolist(), [frame_tokens] * grid_t,
                         per_chunk)
    audio = chunk_bounds(list(range(audio_tokens)), [1] * audio_tokens, per_chunk)
    runs: list[Run] = []
    for j in range(max(len(video), len(audio))):
        if j < len(video):
            runs.append((video_id, video[j][1] - video[j][0]))
        if j < len(audio):
            runs.append((audio_id, audio[j][1] - audio[j][0]))
    return runs


def qwen3_omni_interleave(grid_t: int, frame_tokens: int, second_per_grid: float, audio_tokens: int,
                          video_id: int, audio_id: int) -> list[Run]:
    """``Qwen3OmniMoeProcessor.replace_video_with_audio_token`` without the start/end tokens, as runs: video
    token positions ``t * second_per_grid * 13``, audio ``k``; the lower first, video on a tie."""
    per_second = POSITION_ID_PER_SECONDS["qwen3_omni_moe"]
    runs: list[Run] = []
    audio = 0
    for value in (np.arange(grid_t) * second_per_grid * per_second).tolist():
        first = audio
        while audio < audio_tokens and not value <= audio:
            audio += 1
        runs += [(audio_id, audio - first), (video_id, frame_tokens)]
    runs.append((audio_id, audio_tokens - audio))
    return runs


INTERLEAVE: dict[str, Callable[[int, int, float, int, int, int], list[Run]]] = {
    "qwen2_5_omni": qwen2_5_omni_interleave, "qwen3_omni_moe": qwen3_omni_interleave}


def omni_video_config(model_type: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The video processor's settings as the Omni processor runs it: the bundle's config with the
    processor's ``size`` in place of its pixel bounds."""
    out = {k: v for k, v in cfg.items() if k not in ("min_pixels", "max_pixels", "size")}
    out["video_processor_type"] = QWEN2_VIDEO
    out["size"] = dict(PROCESSOR_VIDEO_SIZE[model_type])
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class AudioTrack:
    """What a clip's audio track needs from the family's audio side: the feature extractor's rate and the audio
    start, pad and end token ids."""

    sampling_rate: int
    start_id: int
    token_id: int
    end_id: int


class OmniVideo(QwenVLVideo):
    """:class:`~mmgate.models.qwen_vl_video.QwenVLVideo` with Omni's tokens, options and ``video_second_per_grid``;
    an :class:`~mmgate.models.family.AudioTrackVideo` (``use_audio_in_video``, module docstring)."""

    def __init__(self, model_type: str, cfg: Mapping[str, Any], token_ids: Mapping[str, int],
                 encode: Callable[[str], list[int]], backend: ImageBackend, sampling: FrameSampling,
                 check_options: Callable[[ItemHints, str], None], track: AudioTrack | None = None) -> None:
        params = video_params("qwen2_vl", omni_video_config(model_type, cfg), sampling)
        super().__init__("qwen2_vl", params, token_ids, encode, backend)
        self.model_type = model_type  # after the base: its Qwen2-VL branches stay off (no second_per_grid_ts)
        #: the fps the processor is called with: the sampling rate where frames are sampled at one (vLLM's 2 fps, as
        #: a vLLM worker passes it), else the processor's default
        fps = params.fps if params.do_sample_frames and params.fps else PROCESSOR_DEFAULT_FPS[model_type]
        #: ``video_second_per_grid`` as the processor computes it (a Python float) and as it returns it (float32)
        self.second_per_grid_exact = params.temporal_patch_size / fps
        self.second_per_grid = float(np.float32(self.second_per_grid_exact))
        self.track = track
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

    def audio_track_rate(self, hints: ItemHints) -> int | None:
        """The audio rate when the request sets ``use_audio_in_video: true``, else None."""
        if self.track is None or hints.option("use_audio_in_video", False) is not True:
            return None
        return self.track.sampling_rate

    def expand_with_audio(self, plan: ItemPlan[VideoDetail], audio: ItemPlan) -> Replacement:
        """``<audio start>``, the clip's and its track's pad tokens interleaved (module docstring), ``<audio end>``;
        the range is the interleaved run (the engine embeds the video tokens of it)."""
        assert self.track is not None
        grid_t, gh, gw = plan.detail.geometry
        frame = (gh // self.p.merge_size) * (gw // self.p.merge_size)
        runs = INTERLEAVE[self.model_type](grid_t, frame, self.second_per_grid_exact, audio.num_tokens,
                                           self.video_token_id, self.track.token_id)
        ids = [self.track.start_id]
        for token, count in runs:
            ids += [token] * count
        ids.append(self.track.end_id)
        return Replacement(token_ids=tuple(ids), embed_offset=1, embed_length=len(ids) - 2)

    def plan(self, video: DecodedVideo, hints: ItemHints) -> ItemPlan[VideoDetail]:
        plan = super().plan(video, hints)
        return dataclasses.replace(plan, shapes=(*plan.shapes[:_BASE_SPECS], ("video_second_per_grid", ())))

    def plan_tensors(self, plan: ItemPlan[VideoDetail]) -> dict[str, np.ndarray]:
        out = {k: v for k, v in super().plan_tensors(plan).items() if k != "second_per_grid_ts"}
        out["video_second_per_grid"] = np.array(self.second_per_grid, dtype=np.float32)
        return out
