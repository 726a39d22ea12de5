"""Live tier: Qwen2-VL / Qwen2.5-VL video sampling against transformers 5.24 and vLLM, on generated clips.

Each run makes ``NUM_CLIPS`` clips with PyAV: the fixed ones below (one frame, 2 and 3 frames,
400 frames at 1 and 60 fps, and clips whose float32 arange runs past the last frame) plus random
ones, 1..400 frames (log-uniform), 1..60 fps, odd sizes 17..111 px; the seed is printed and can be
pinned with ``MMGATE_PARITY_SEED``.  For each clip and each of Qwen2-VL and Qwen2.5-VL:

* ``--video-frame-sampling vllm`` (the default): the indices mmgate samples equal the port of vLLM's
  ``Qwen2VLVideoBackend.compute_frames_index_to_sample`` (``tests.support.vllm_video.vllm_qwen2_indices``) and
  ``Qwen2VLVideoProcessor.sample_frames(metadata, fps=2)``; the ids, ``video_grid_thw``,
  ``second_per_grid_ts`` and ``pixel_values`` equal the processor called with
  ``do_sample_frames=True, fps=2``.  Where that arange yields an index equal to the frame count (the
  processor then fails with ``IndexError``; vLLM clamps it to the last frame), they equal the
  processor on vLLM's frames with their ``frames_indices``, as a vLLM worker hands them over; where
  it yields no frame (one frame: both divide by zero), mmgate keeps the frame (docs/video.md) and
  equals the processor's default;
* ``--video-frame-sampling transformers``: every frame, and everything equal to the processor's
  default (``do_sample_frames=False``).
"""

from __future__ import annotations

import math
import os
import secrets
import time
from pathlib import Path

import numpy as np
import pytest

from mmgate.models.backend import FrameSampling
from mmgate.types import ItemHints, VideoMeta
from tests.support.vllm_video import VLLM_FPS, vllm_qwen2_indices
from tests.video.video_support import (
    QWEN2,
    QWEN2_5,
    ClipSpec,
    load,
    make_clip,
    pipeline,
    prepare,
    processor,
    reference,
    video_part,
)

SEED = int(os.environ.get("MMGATE_PARITY_SEED") or secrets.randbits(32))
print(f"\n[qwen2 video live parity] seed={SEED} (rerun with MMGATE_PARITY_SEED={SEED})")

NUM_CLIPS = 56
#: (frames, fps, width, height): edges, and clips whose arange at 2 fps yields n + 1 indices
FIXED = ((1, 24, 33, 17), (2, 1, 29, 31), (3, 60, 41, 23), (400, 60, 23, 19), (400, 1, 19, 23),
         (61, 8, 45, 27), (59, 1, 31, 45), (115, 15, 37, 29))
MODELS = (QWEN2, QWEN2_5)


def corpus(folder: Path) -> list[ClipSpec]:
    rng = np.random.default_rng(SEED)
    specs = [ClipSpec(f"fixed{i}_{n}f_{fps}fps", n, fps, w, h) for i, (n, fps, w, h) in enumerate(FIXED)]
    while len(specs) < NUM_CLIPS:
        n = int(round(math.exp(rng.uniform(0.0, math.log(400)))))
        fps = int(rng.integers(1, 61))
        w, h = (int(v) | 1 for v in rng.integers(17, 112, size=2))  # odd sides (libx264 in yuv444p)
        specs.append(ClipSpec(f"r{len(specs)}_{n}f_{fps}fps_{w}x{h}", n, fps, w, h))
    return specs


@pytest.fixture(scope="module")
def live_clips(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[ClipSpec, Path]]:
    folder = tmp_path_factory.mktemp("live-clips")
    return [(spec, make_clip(spec, folder)) for spec in corpus(folder)]


def expected_indices(total: int, fps: float) -> tuple[list[int], str]:
    """(indices, how the reference gets them): vLLM's port, checked against transformers' sample_frames."""
    from transformers.video_utils import VideoMetadata

    try:
        ported = vllm_qwen2_indices(total, fps)
    except ZeroDivisionError:
        with pytest.raises(ZeroDivisionError):
            processor(QWEN2).video_processor.sample_frames(VideoMetadata(total_num_frames=total, fps=fps), fps=VLLM_FPS)
        return list(range(total)), "no frame to sample: every frame"
    theirs = processor(QWEN2).video_processor.sample_frames(VideoMetadata(total_num_frames=total, fps=fps),
                                                           fps=VLLM_FPS).tolist()
    if theirs[-1] == total:  # transformers would index past the frames; vLLM clamps the tail
        assert theirs[:-1] == ported[:-1] and ported[-1] == total - 1
        return ported, "clamped tail"
    assert theirs == ported
    return ported, "sampled"


def differences(prepared, ref) -> list[str]:  # noqa: ANN001 - PreparedRequest, video_support.Reference
    (batch,) = prepared.batches
    out: list[str] = []
    if prepared.input_ids != tuple(ref.input_ids):
        out.append(f"input_ids ({len(prepared.input_ids)} vs {len(ref.input_ids)})")
    if not np.array_equal(batch.tensors["video_grid_thw"], ref.out["video_grid_thw"]):
        out.append(f"video_grid_thw {batch.tensors['video_grid_thw'].tolist()} vs {ref.out['video_grid_thw'].tolist()}")
    pixels = ref.out["pixel_values_videos"]
    if batch.tensors["pixel_values"].shape != pixels.shape or not np.array_equal(batch.tensors["pixel_values"], pixels):
        out.append("pixel_values")
    if "second_per_grid_ts" in ref.out:
        if not np.array_equal(batch.tensors["second_per_grid_ts"],
                              np.asarray(ref.out["second_per_grid_ts"], dtype=np.float32)):
            out.append(f"second_per_grid_ts {batch.tensors['second_per_grid_ts']} vs {ref.out['second_per_grid_ts']}")
    elif "second_per_grid_ts" in batch.tensors:
        out.append("second_per_grid_ts sent for a model without it")
    return out


@pytest.mark.parametrize("model", MODELS)
def test_generated_clips_sample_as_vllm_and_equal_transformers_under_both_settings(
        model: str, live_clips: list[tuple[ClipSpec, Path]]) -> None:
    started = time.perf_counter()
    failures: list[str] = []
    kinds: dict[str, int] = {}
    for spec, path in live_clips:
        loaded = load(path)
        frames, meta = loaded
        total, fps = int(meta.total_num_frames), float(meta.fps)
        assert (total, len(frames)) == (spec.frames, spec.frames)
        header = VideoMeta(total_frames=total, fps=fps, height=spec.height, width=spec.width, codec="h264",
                           container="mp4")

        indices, kind = expected_indices(total, fps)
        kinds[kind] = kinds.get(kind, 0) + 1
        ours = pipeline(model).runtime.family.video.sample(header, ItemHints())
        if ours != indices:
            failures.append(f"{spec.name} vllm: indices {ours} vs {indices}")
        if kind == "sampled":
            ref = reference(model, path, loaded=loaded, video_kwargs={"do_sample_frames": True, "fps": VLLM_FPS})
            assert ref.indices == indices
        elif kind == "clamped tail":
            ref = reference(model, path, loaded=loaded, indices=indices)
        else:
            ref = reference(model, path, loaded=loaded)
        failures += [f"{spec.name} vllm: {d}" for d in differences(prepare(model, [video_part(path)]), ref)]

        every = pipeline(model, FrameSampling.TRANSFORMERS).runtime.family.video.sample(header, ItemHints())
        if every != list(range(total)):
            failures.append(f"{spec.name} transformers: indices {every}")
        ref = reference(model, path, loaded=loaded)
        assert ref.indices == list(range(total))
        prepared = prepare(model, [video_part(path)], sampling=FrameSampling.TRANSFORMERS)
        failures += [f"{spec.name} transformers: {d}" for d in differences(prepared, ref)]
    print(f"[{model}] seed={SEED}: {len(live_clips)} clips {kinds}, {time.perf_counter() - started:.1f}s")
    assert not failures, f"seed={SEED} {model}:\n" + "\n".join(failures)
    assert len(live_clips) >= 50 and kinds.get("clamped tail", 0) >= 3 and kinds.get("no frame to sample: every frame")
