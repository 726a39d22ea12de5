"""Rotated phone clips come out upright (issue 10, part 2), and ``--no-video-apply-rotation`` keeps the reference.

Clips are made here with PyAV's ``VideoStream.set_display_rotation`` (the display matrix a phone
writes).  Expected values come from outside mmgate:

* orientation: the ``ffmpeg`` CLI (installed by ``scripts/setup.sh``) decodes with its default
  ``autorotate``; mmgate's upright frames equal its frames;
* tensors: the transformers 5.24 processor run on the reference loader's frames
  (``load_video(path, backend="pyav")``, stored orientation) turned upright by this test with
  ``np.rot90`` (the display matrix angle is counter-clockwise), sampling as the default
  ``--video-frame-sampling vllm`` (``vllm_video_kwargs``): ``video_grid_thw``, the expanded
  ``input_ids`` and ``pixel_values`` (max |diff| 0) equal mmgate's with rotation applied (the default).
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import subprocess
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from mmgate.request.parse import parse_chat_request
from mmgate.media.fetch import MediaFetcher
from mmgate.media.video import decode_video, upright_turns
from mmgate.pipeline.prepare import Pipeline
from mmgate.config.settings import Settings, VideoSettings, parse_settings
from mmgate.types import PreparedRequest
from tests.video.video_support import (
    MODELS,
    ClipSpec,
    load,
    make_clip,
    pipeline,
    processor,
    video_part,
    vllm_video_kwargs,
)

#: 128 wide x 64 high as stored, so the upright grid is the stored one transposed
ANGLES = (90, 270)


@pytest.fixture(scope="module")
def rotated(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Display-matrix angle (as written with ``set_display_rotation``) -> an 8-frame 4 fps 128x64 clip."""
    folder = tmp_path_factory.mktemp("rotated")
    return {angle: make_clip(ClipSpec(f"rot{angle}", 8, 4, 128, 64, rotation=angle), folder)
            for angle in (*ANGLES, 180, 0)}


@cache
def upright_pipeline(model: str) -> Pipeline:
    """The parity pipeline's runtime with the gateway's default settings (rotation applied)."""
    base = pipeline(model)
    settings = Settings(model=model)
    assert settings.video.apply_rotation
    return Pipeline(base.runtime, settings, MediaFetcher(settings.fetch), ThreadPoolExecutor(2))


def prepare_with(pipe: Pipeline, path: Path, text: str = "What happens?") -> PreparedRequest:
    body = {"model": pipe.runtime.served_name,
            "messages": [{"role": "user", "content": [video_part(path), {"type": "text", "text": text}]}]}
    return asyncio.run(pipe.prepare(parse_chat_request(json.dumps(body).encode())))


def ffmpeg_frames(path: Path, shape: tuple[int, ...]) -> np.ndarray:
    """Every frame as the ``ffmpeg`` CLI decodes it (autorotate on, its default), RGB."""
    ffmpeg = shutil.which("ffmpeg")
    assert ffmpeg, "ffmpeg is installed by scripts/setup.sh"
    out = subprocess.run([ffmpeg, "-v", "error", "-i", str(path), "-f", "rawvideo", "-pix_fmt", "rgb24", "-"],
                         capture_output=True, check=True, timeout=60).stdout
    return np.frombuffer(out, dtype=np.uint8).reshape(shape)


@pytest.mark.parametrize("angle", (*ANGLES, 180))
def test_rotated_clip_decodes_upright_as_ffmpeg_autorotate_does(angle: int, rotated: dict[int, Path]) -> None:
    path = rotated[angle]
    ours = decode_video(path.read_bytes(), lambda meta: list(range(meta.total_frames)), None, 30.0,
                        apply_rotation=True)
    stored = decode_video(path.read_bytes(), lambda meta: list(range(meta.total_frames)), None, 30.0)

    assert ours.frames.shape == ((8, 128, 64, 3) if angle in ANGLES else (8, 64, 128, 3))
    assert stored.frames.shape == (8, 64, 128, 3)
    assert ours.frames.flags.c_contiguous
    # ffmpeg (the system build) and PyAV's bundled FFmpeg run the same swscale conversion: equal up to
    # rounding; a wrong orientation differs by far more (the frames are gradients plus noise).
    theirs = ffmpeg_frames(path, ours.frames.shape)
    assert int(np.abs(theirs.astype(np.int16) - ours.frames).max()) <= 2
    # Exact quarter turns of the stored frames, no resampling.
    assert np.array_equal(ours.frames, np.rot90(stored.frames, upright_turns(ours.rotation), axes=(1, 2)))


def test_upright_turns_follow_the_counter_clockwise_display_angle() -> None:
    # VideoFrame.rotation is av_display_rotation_get: counter-clockwise degrees in [-180, 180].
    assert [upright_turns(a) for a in (0, 90, -90, 180, -180, 270, 45, 89)] == [0, 1, 3, 2, 2, 3, 0, 1]


def upright_reference(model: str, path: Path, angle: int, text: str = "What happens?") -> tuple[np.ndarray, dict]:
    """The processor on the reference loader's frames turned upright here: (upright frames, outputs)."""
    proc = processor(model)
    frames, meta = load(path)
    upright = np.ascontiguousarray(np.rot90(frames, angle // 90, axes=(1, 2)))
    meta = copy.deepcopy(meta)
    meta.height, meta.width = upright.shape[1], upright.shape[2]
    content = [{"type": "video"}, {"type": "text", "text": text}]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(text=[prompt], videos=[upright], video_metadata=[meta], return_tensors="np",
                   videos_kwargs={"cap_pixels_per_frame": False, **vllm_video_kwargs(model)})
    return upright, dict(out)


@pytest.mark.parametrize("angle", ANGLES)
@pytest.mark.parametrize("model", MODELS)
def test_upright_clip_equals_the_reference_on_upright_frames(model: str, angle: int,
                                                             rotated: dict[int, Path]) -> None:
    path = rotated[angle]
    upright, ref = upright_reference(model, path, angle)
    assert upright.shape[1:] == (128, 64, 3)

    prepared = prepare_with(upright_pipeline(model), path)
    (batch,) = prepared.batches
    (plan,) = prepared.plans
    assert plan.original_hw == (128, 64)
    assert np.array_equal(batch.tensors["video_grid_thw"], ref["video_grid_thw"])
    grid_t, grid_h, grid_w = (int(v) for v in ref["video_grid_thw"][0])
    assert grid_h > grid_w  # portrait: the stored (landscape) grid transposed
    assert prepared.input_ids == tuple(int(t) for t in ref["input_ids"][0])
    assert batch.tensors["pixel_values"].shape == ref["pixel_values_videos"].shape
    assert float(np.abs(batch.tensors["pixel_values"] - ref["pixel_values_videos"]).max()) == 0.0


def test_switch_off_keeps_the_reference_loaders_orientation(rotated: dict[int, Path]) -> None:
    """``--no-video-apply-rotation``: the stored orientation, tensors equal to the reference loader's path."""
    model = MODELS[0]
    path = rotated[270]
    frames, _ = load(path)
    assert frames.shape[1:] == (64, 128, 3)
    off, on = prepare_with(pipeline(model), path), prepare_with(upright_pipeline(model), path)
    assert not pipeline(model).settings.video.apply_rotation
    (stored_plan,), (upright_plan,) = off.plans, on.plans
    assert stored_plan.original_hw == (64, 128) and upright_plan.original_hw == (128, 64)
    t, h, w = stored_plan.detail.geometry
    assert upright_plan.detail.geometry == (t, w, h)
    # The same bytes turned upright are other tensors: they must not share a cache key.
    assert off.batches[0].mm_hashes != on.batches[0].mm_hashes
    # An unrotated clip hashes the same either way.
    plain_off, plain_on = prepare_with(pipeline(model), rotated[0]), prepare_with(upright_pipeline(model), rotated[0])
    assert plain_off.batches[0].mm_hashes == plain_on.batches[0].mm_hashes


def test_rotation_switch_flag_and_environment() -> None:
    assert parse_settings(["--model", "m"], {}).video == VideoSettings(apply_rotation=True)
    assert not parse_settings(["--model", "m", "--no-video-apply-rotation"], {}).video.apply_rotation
    assert not parse_settings(["--model", "m"], {"MMGATE_VIDEO_APPLY_ROTATION": "0"}).video.apply_rotation
    assert parse_settings(["--model", "m", "--video-apply-rotation"],
                          {"MMGATE_VIDEO_APPLY_ROTATION": "0"}).video.apply_rotation
