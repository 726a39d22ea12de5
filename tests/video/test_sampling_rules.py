"""Frame sampling against the reference video processors' ``sample_frames`` and vLLM's video loader,
from metadata alone.

No clip is decoded: for frame counts 1..400 plus long clips, source rates
24/25/29.97/30/60 and every sampling setting (each ``--video-frame-sampling``, the
``fps`` hint), mmgate's indices equal what ``Qwen2VLVideoProcessor`` /
``Qwen3VLVideoProcessor.sample_frames`` return, called as the setting says
(``vllm``: Qwen2/2.5-VL ``do_sample_frames=True, fps=2``; ``transformers``: the
processor's own default).  Where the reference cannot answer, the expected value
is written out here: an index equal to the frame count (transformers then fails
with ``IndexError``) is clamped to the last frame, as vLLM does; a clip too short
to sample (``n`` floors to 0: the reference divides by zero) keeps every frame.
The default Qwen2/2.5-VL sampling also equals the port of vLLM's
``Qwen2VLVideoBackend.compute_frames_index_to_sample`` (:mod:`tests.support.vllm_video`).
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest

from mmgate.errors import GatewayError
from mmgate.models.qwen_vl_frames import QWEN3_VIDEO, sample_indices, torch_arange_int
from mmgate.models.backend import FrameSampling
from mmgate.types import ItemHints, VideoMeta
from tests.support.vllm_video import VLLM_FPS, vllm_qwen2_indices
from tests.video.video_support import (
    MODELS,
    QWEN2,
    QWEN2_5,
    QWEN3,
    pipeline,
    processor,
)

TOTALS = (*range(1, 122), 149, 150, 151, 199, 240, 241, 300, 301, 399, 400, 599, 600, 1799, 1800, 7201, 23_999)
SOURCE_FPS = (24.0, 25.0, 30000 / 1001, 30.0, 60.0)
HINTS = (None, 0.2, 0.7, 2.0, 3.3, 5.0)


def reference_indices(model: str, total: int, source_fps: float, fps_hint: float | None,
                      sampling: FrameSampling) -> list[int] | None:
    """What the reference keeps for a clip of ``total`` frames, called as ``sampling`` says (None: it raises
    otherwise than on the two cases the module docstring names)."""
    from transformers.video_utils import VideoMetadata

    vp = processor(model).video_processor
    fps = fps_hint
    if fps is None and sampling is FrameSampling.VLLM and not vp.do_sample_frames:
        fps = VLLM_FPS  # Qwen2VLVideoProcessor: vLLM samples where the processor's default does not
    if fps is None and not vp.do_sample_frames:
        return list(range(total))  # no sampling: every decoded frame is processed
    meta = VideoMetadata(total_num_frames=total, fps=source_fps)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = vp.sample_frames(meta, fps=fps if fps is not None else vp.fps, num_frames=None)
    except ZeroDivisionError:
        return list(range(total)) if total < vp.temporal_patch_size else None
    except ValueError:
        return None
    return [min(int(i), total - 1) for i in np.asarray(out)]


@pytest.mark.parametrize("sampling", tuple(FrameSampling), ids=lambda m: m.value)
@pytest.mark.parametrize("model", MODELS[1:])  # Qwen2-VL builds the same Qwen2VLVideoProcessor as Qwen2.5-VL
def test_sampled_indices_equal_the_reference_for_every_length_rate_and_hint(model: str,
                                                                             sampling: FrameSampling) -> None:
    video = pipeline(model, sampling).runtime.family.video
    mismatches = []
    for total in TOTALS:
        for source_fps in SOURCE_FPS:
            meta = VideoMeta(total_frames=total, fps=source_fps, height=48, width=64, codec="h264", container="mp4")
            for hint in HINTS:
                expected = reference_indices(model, total, source_fps, hint, sampling)
                try:
                    got: list[int] | None = sample_indices(video.p, meta, ItemHints(fps=hint))
                except GatewayError:
                    got = None
                if got != expected:
                    mismatches.append((total, source_fps, hint, got, expected))
    assert mismatches == []


@pytest.mark.parametrize("model", [QWEN2, QWEN2_5])
def test_default_sampling_is_vllms_qwen2_video_backend(model: str) -> None:
    """Every length 2..400 at 1..60 fps (and the long clips): the indices of the port of vLLM's
    ``compute_frames_index_to_sample``; about 1.4% of them end in vLLM's clamped tail index."""
    video = pipeline(model).runtime.family.video
    mismatches, clamped = [], 0
    for total in (*range(2, 401), *TOTALS[-6:]):
        for source_fps in (*range(1, 61), 30000 / 1001):
            meta = VideoMeta(total_frames=total, fps=float(source_fps), height=48, width=64, codec="h264",
                             container="mp4")
            expected = vllm_qwen2_indices(total, float(source_fps))
            clamped += len(expected) % 2  # n is even: an odd count is n + 1, the tail clamped
            got = sample_indices(video.p, meta, ItemHints())
            if got != expected:
                mismatches.append((total, source_fps, got, expected))
    assert mismatches == []
    assert clamped > 100  # the odd-length (clamped-tail) case is exercised


def test_a_one_frame_clip_keeps_its_frame_where_vllm_divides_by_zero() -> None:
    video = pipeline(QWEN2).runtime.family.video
    meta = VideoMeta(total_frames=1, fps=30.0, height=48, width=64, codec="h264", container="mp4")
    with pytest.raises(ZeroDivisionError):
        vllm_qwen2_indices(1, 30.0)
    assert sample_indices(video.p, meta, ItemHints()) == [0]


def test_qwen2_and_qwen2_5_build_the_same_video_processor() -> None:
    assert type(processor(QWEN2).video_processor) is type(processor(QWEN2_5).video_processor)
    for sampling in FrameSampling:
        assert pipeline(QWEN2, sampling).runtime.family.video.p == pipeline(QWEN2_5, sampling).runtime.family.video.p


def test_qwen3_default_is_two_frames_per_second_within_min_and_max_frames() -> None:
    video = pipeline(QWEN3).runtime.family.video
    assert video.p.processor == QWEN3_VIDEO and video.p.fps == 2.0
    assert video.p == pipeline(QWEN3, FrameSampling.TRANSFORMERS).runtime.family.video.p  # one rule under both
    meta = VideoMeta(total_frames=300, fps=30.0, height=48, width=64, codec="h264", container="mp4")
    # int(300 / 30 * 2) = 20 frames, np.linspace(0, 299, 20).round()
    assert sample_indices(video.p, meta, ItemHints()) == [int(i) for i in np.linspace(0, 299, 20).round()]
    short = VideoMeta(total_frames=10, fps=30.0, height=48, width=64, codec="h264", container="mp4")
    assert len(sample_indices(video.p, short, ItemHints())) == 4  # min_frames


def test_qwen2_index_arithmetic_equals_torch_arange_on_float32() -> None:
    """``torch.arange(0, total, total / n).int()`` fills float32 in 8-lane SIMD blocks with float64 sums, so
    long clips get layout-dependent low bits; mmgate models that layout without torch.  On x86 torch runs it
    with 8 lanes under every CPU capability (AVX512 included), so the comparison holds on any x86 machine."""
    import platform

    torch = pytest.importorskip("torch")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the 8-lane layout is measured on x86; aarch64 torch builds use other Vectorized<float> widths")
    rng = random.Random(0)
    for _ in range(800):
        total = rng.randint(2, 200_000)
        n = rng.randrange(2, min(768, total) + 1, 2)
        expected = torch.arange(0, total, total / n).int().tolist()
        assert torch_arange_int(total, n) == expected, (total, n, torch.backends.cpu.get_cpu_capability())
