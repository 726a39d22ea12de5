"""mmgate's video path against the transformers 5.24 reference, clip by clip and model by model.

For every clip of ``video_support.CLIPS`` (1, 2, 3, 5, 17, 60 and 301 frames;
24, 25, 30 and 60 fps; odd sizes; mpeg4; 90-degree rotation metadata; a
variable-frame-rate clip), each of Qwen2-VL, Qwen2.5-VL and Qwen3-VL and each
``--video-frame-sampling`` (``vllm``: the processor called with
``vllm_video_kwargs``, for Qwen2/2.5-VL ``do_sample_frames=True, fps=2``;
``transformers``: the processor's own default, for Qwen2/2.5-VL every frame;
Qwen3-VL is its own default under both):

* decoded frames: mmgate's decoder (``mmgate.media.video``, PyAV) gives the
  frames the reference's own loader (``load_video(path, backend="pyav")``)
  gives at the same indices, byte for byte;
* sampled indices equal what the reference video processor keeps
  (``return_metadata=True``), and Qwen3-VL timestamps equal
  ``Qwen3VLProcessor._calculate_timestamps``;
* ``video_grid_thw``, the expanded ``input_ids``, ``pixel_values`` (max abs
  diff 0, from mmgate's frames and from the reference's frames) and, for
  Qwen2.5-VL, ``second_per_grid_ts`` equal the processor's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.video import decode_video
from mmgate.models.qwen_vl_frames import qwen3_timestamps
from mmgate.models.backend import FrameSampling
from mmgate.types import DecodedVideo, ItemHints
from tests.video.video_support import (
    CLIPS,
    MODELS,
    QWEN2_5,
    QWEN3,
    ClipSpec,
    pipeline,
    prepare,
    processor,
    reference,
    video_part,
    vllm_video_kwargs,
)

SAMPLINGS = tuple(FrameSampling)


def decode(model: str, path: Path, sampling: FrameSampling = FrameSampling.VLLM) -> DecodedVideo:
    family = pipeline(model, sampling).runtime.family
    return decode_video(path.read_bytes(), lambda meta: family.video.sample(meta, ItemHints()), None, 30.0)


def reference_for(model: str, path: Path, sampling: FrameSampling):  # noqa: ANN201 - video_support.Reference
    """The processor as the setting says: vLLM's sampling kwargs, or the processor's own default."""
    return reference(model, path, video_kwargs=vllm_video_kwargs(model) if sampling is FrameSampling.VLLM else None)


@pytest.mark.parametrize("spec", [c for c in CLIPS if not (c.frames < 2)], ids=lambda c: c.name)
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=lambda m: m.value)
@pytest.mark.parametrize("model", MODELS)
def test_clip_is_frame_for_frame_and_token_for_token_the_reference(model: str, sampling: FrameSampling,
                                                                    spec: ClipSpec, clips: dict[str, Path]) -> None:
    path = clips[spec.name]
    ref = reference_for(model, path, sampling)
    ours = decode(model, path, sampling)

    assert list(ours.frame_indices) == ref.indices
    assert ours.meta.total_frames == spec.frames and ours.meta.fps == ref.fps
    assert np.array_equal(ours.frames, ref.frames[ref.indices])  # same decoder, same swscale call: identical
    if model == QWEN3:
        assert qwen3_timestamps(ours.frame_indices, ours.meta.fps, 2) == processor(model)._calculate_timestamps(
            ref.indices, ref.fps, 2)

    prepared = prepare(model, [video_part(path)], sampling=sampling)
    (batch,) = prepared.batches
    assert prepared.input_ids == tuple(ref.input_ids)
    assert np.array_equal(batch.tensors["video_grid_thw"], ref.out["video_grid_thw"])
    pixels = ref.out["pixel_values_videos"]
    assert batch.tensors["pixel_values"].shape == pixels.shape
    assert float(np.abs(batch.tensors["pixel_values"] - pixels).max()) == 0.0
    if model == QWEN2_5:
        # The processor's list becomes a float32 tensor under return_tensors="pt" (what the model reads).
        expected = np.asarray(ref.out["second_per_grid_ts"], dtype=np.float32)
        assert np.array_equal(batch.tensors["second_per_grid_ts"], expected)
    else:
        assert "second_per_grid_ts" not in batch.tensors

    # Given the reference loader's frames, preprocessing alone is exact too.
    family = pipeline(model, sampling).runtime.family
    theirs = DecodedVideo(frames=np.ascontiguousarray(ref.frames[ref.indices]), meta=ours.meta,
                          frame_indices=tuple(ref.indices), rotation=0, content_hash="", num_bytes=0)
    rows = family.video.preprocess(theirs, family.video.plan(theirs, ItemHints()))
    assert float(np.abs(rows - pixels).max()) == 0.0


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=lambda m: m.value)
@pytest.mark.parametrize("model", MODELS)
def test_one_frame_clip_follows_the_reference(model: str, sampling: FrameSampling, clips: dict[str, Path]) -> None:
    """Qwen2/2.5-VL keep the one frame and pad time, under either setting: vLLM's 2 fps sampling would
    divide by zero on it (``n = floor(min(768, 1) / 2) * 2 = 0``; transformers' ``sample_frames`` raises
    ``ZeroDivisionError``), so mmgate falls back to the processor's default, every frame (docs/video.md).
    Qwen3-VL's processor refuses fewer than 2 frames."""
    path = clips["f1_24fps"]
    if model != QWEN3:
        with pytest.raises(ZeroDivisionError):
            reference(model, path, video_kwargs=vllm_video_kwargs(model))
        ref = reference(model, path)
        prepared = prepare(model, [video_part(path)], sampling=sampling)
        assert prepared.input_ids == tuple(ref.input_ids)
        assert ref.out["video_grid_thw"].tolist() == [[1, 4, 4]]
        assert np.array_equal(prepared.batches[0].tensors["pixel_values"], ref.out["pixel_values_videos"])
        return
    with pytest.raises(ValueError, match="must be larger than temporal_factor"):
        reference(model, path)
    with pytest.raises(GatewayError) as err:
        prepare(model, [video_part(path)], sampling=sampling)
    assert err.value.code is ErrorCode.INVALID_REQUEST and err.value.status == 400


def test_rotation_metadata_is_read_but_not_applied_like_the_reference(clips: dict[str, Path]) -> None:
    """The reference's pyav loader ignores the display matrix: frames keep their stored 64x48 shape."""
    path = clips["f8_4fps_rot90"]
    ours = decode(QWEN3, path)
    ref = reference(QWEN3, path)
    assert ours.rotation == 90
    assert ours.frames.shape[1:] == ref.frames.shape[1:] == (48, 64, 3)


def test_clip_without_a_header_frame_count_is_counted_by_decoding(tmp_path: Path) -> None:
    """WebM stores no frame count (the reference's loader fails on it: IndexError); mmgate counts the
    frames and samples the clip as the reference samples a clip of that many frames."""
    from tests.video.video_support import make_clip

    webm = make_clip(ClipSpec("w", 10, 24, 64, 48, codec="libvpx", container="webm"), tmp_path)
    mp4 = make_clip(ClipSpec("m", 10, 24, 64, 48), tmp_path)
    ours = decode(QWEN3, webm)
    assert ours.meta.frames_counted and ours.meta.total_frames == 10
    assert list(ours.frame_indices) == reference(QWEN3, mp4).indices  # the same 10-frame sampling
