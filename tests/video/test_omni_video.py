"""Qwen2.5-Omni and Qwen3-Omni videos through the pipeline against the transformers 5.24 processors.

A clip (and a clip with an image) gives the processor's ``input_ids``, ``pixel_values_videos``,
``video_grid_thw`` and ``video_second_per_grid`` on the frames a vLLM worker samples (the processor called
with ``do_sample_frames=True, fps=2``, as for Qwen2.5-VL): the Omni processors run ``Qwen2VLVideoProcessor``
with their own ``videos_kwargs`` size (128-768 merged patches per frame), which the clip path must take
over the bundle's pixel bounds; a large clip shows it.  A second clip in one request is over the limit (1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mmgate.errors import ErrorCode, GatewayError
from mmgate.types import Modality
from tests.video.video_support import ClipSpec, make_clip, prepare, reference, video_part, vllm_video_kwargs

OMNI = ("Qwen/Qwen2.5-Omni-7B", "Qwen/Qwen3-Omni-30B-A3B-Instruct")


def check(model: str, path: Path) -> None:
    prepared = prepare(model, [video_part(path)])
    ref = reference(model, path, video_kwargs=vllm_video_kwargs(model))
    assert prepared.input_ids == tuple(ref.input_ids)
    (video,) = prepared.batches
    assert video.modality is Modality.VIDEO
    assert np.array_equal(video.tensors["pixel_values"], ref.out["pixel_values_videos"])
    assert np.array_equal(video.tensors["video_grid_thw"], ref.out["video_grid_thw"])
    assert np.array_equal(video.tensors["video_second_per_grid"],
                          np.asarray(ref.out["video_second_per_grid"], dtype=np.float32))


@pytest.mark.parametrize("model", OMNI, ids=lambda m: m.split("/")[1])
@pytest.mark.parametrize("clip", ["f17_25fps_mpeg4", "f20_vfr"])
def test_a_clip_equals_the_processor(model: str, clip: str, clips: dict[str, Path]) -> None:
    check(model, clips[clip])


@pytest.mark.parametrize("model", OMNI, ids=lambda m: m.split("/")[1])
def test_a_large_clip_takes_the_processor_s_video_size_not_the_bundle_s(model: str, tmp_path: Path) -> None:
    path = make_clip(ClipSpec("big", 3, 2, 1280, 960), tmp_path)
    check(model, path)


def test_a_second_clip_is_over_the_limit(clips: dict[str, Path]) -> None:
    path = clips["f2_25fps"]
    with pytest.raises(GatewayError) as err:
        prepare(OMNI[1], [video_part(path), video_part(path)])
    assert err.value.code is ErrorCode.MM_ITEM_LIMIT_EXCEEDED
