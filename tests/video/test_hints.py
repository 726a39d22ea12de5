"""Per-item hints: ``video_url.fps`` and ``{image,video}_url.max_long_side_pixel``.

A hinted part is exact to the reference called with the equivalent kwargs
(docs/video.md, "Hints"):
* ``fps=F`` -> video processor kwargs ``do_sample_frames=True, fps=F``;
* ``max_long_side_pixel=L`` -> ``size={"shortest_edge": <config>, "longest_edge": A}``
  with ``A`` the per-item bound mmgate computes (``long_side_bound``).
Bad values are 400 ``invalid_request`` before anything is fetched.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.models import geometry
from mmgate.models.qwen_vl_frames import long_side_bound
from mmgate.models.backend import FrameSampling
from mmgate.types import ItemHints, VideoMeta
from tests.support.servers import media_origin
from tests.video.video_support import (
    MODELS,
    QWEN2_5,
    QWEN3,
    assert_same,
    loopback_gateway,
    pipeline,
    prepare,
    reference,
    video_part,
    vllm_video_kwargs,
)


def _png(h: int, w: int) -> bytes:
    arr = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("clip,fps", [("f301_24fps_tiny", 0.2), ("f301_24fps_tiny", 0.5), ("f60_30fps", 5.0)])
@pytest.mark.parametrize("model", MODELS)
def test_fps_hint_samples_as_the_reference_with_do_sample_frames_and_fps(model: str, clip: str, fps: float,
                                                                         clips: dict[str, Path]) -> None:
    path = clips[clip]
    ref = reference(model, path, video_kwargs={"do_sample_frames": True, "fps": fps})
    assert_same(prepare(model, [video_part(path, fps=fps)]), ref)


@pytest.mark.parametrize("sampling", tuple(FrameSampling), ids=lambda m: m.value)
def test_fps_hint_where_the_reference_indexes_past_the_last_frame_clamps_that_index_as_vllm(
        sampling: FrameSampling, clips: dict[str, Path]) -> None:
    """301 frames at 24 fps sampled at 5 fps: floor(62.7 / 2) * 2 = 62 frames, but
    ``torch.arange(0, 301, 301 / 62)`` yields 63 values, the last 301: transformers raises IndexError.
    mmgate clamps it to 300, as vLLM's ``Qwen2VLVideoBackend.compute_frames_index_to_sample`` does: 63
    frames, 32 temporal patches (the last padded), what the processor computes from those frames."""
    import torch

    path = clips["f301_24fps_tiny"]
    with pytest.raises(IndexError):
        reference(QWEN2_5, path, video_kwargs={"do_sample_frames": True, "fps": 5.0})
    indices = [min(int(i), 300) for i in torch.arange(0, 301, 301 / 62).int()]
    assert len(indices) == 63 and indices[-2:] == [296, 300]
    prepared = prepare(QWEN2_5, [video_part(path, fps=5.0)], sampling=sampling)
    meta = VideoMeta(total_frames=301, fps=24.0, height=32, width=48, codec="h264", container="mp4")
    assert pipeline(QWEN2_5, sampling).runtime.family.video.sample(meta, ItemHints(fps=5.0)) == indices
    assert prepared.batches[0].tensors["video_grid_thw"][0][0] == 32
    assert_same(prepared, reference(QWEN2_5, path, indices=indices))


@pytest.mark.parametrize("model", MODELS)
def test_max_long_side_hint_on_a_clip_is_the_reference_with_that_longest_edge(model: str,
                                                                              clips: dict[str, Path]) -> None:
    path = clips["f60_30fps"]  # 160x90
    family = pipeline(model).runtime.family
    factor = family.video.p.factor
    long_side = 2 * factor
    prepared = prepare(model, [video_part(path, max_long_side_pixel=long_side)])
    plan = prepared.plans[0]
    assert max(plan.resized_hw) <= long_side
    sampled = vllm_video_kwargs(model)  # the default --video-frame-sampling
    n = len(reference(model, path, video_kwargs=sampled).indices)  # Qwen3-VL's bound counts every sampled frame
    bound = family.video.max_pixels_for(n, 90, 160, ItemHints(max_long_side_pixel=long_side))
    assert bound < family.video.p.max_pixels
    size = {"shortest_edge": family.video.p.min_pixels, "longest_edge": bound}
    assert_same(prepared, reference(model, path, video_kwargs={**sampled, "size": size}))


@pytest.mark.parametrize("model", MODELS)
def test_hinted_image_and_hinted_clip_in_one_request_match_the_reference(model: str, clips: dict[str, Path]) -> None:
    path = clips["f17_25fps_mpeg4"]
    family = pipeline(model).runtime.family
    png = _png(300, 420)
    long_side = 7 * family.image.params.factor
    parts = [video_part(path, fps=2.0), {"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(png).decode(),
        "max_long_side_pixel": long_side}}]
    prepared = prepare(model, parts)
    image_plan = prepared.plans[1]
    assert max(image_plan.resized_hw) <= long_side
    bound = family.image.image_max_pixels(300, 420, ItemHints(max_long_side_pixel=long_side))
    image_kwargs = {"size": {"shortest_edge": family.image.params.min_pixels, "longest_edge": bound}}
    ref = reference(model, path, images=[Image.open(io.BytesIO(png))],
                    video_kwargs={"do_sample_frames": True, "fps": 2.0}, image_kwargs=image_kwargs)
    assert [b.modality.value for b in prepared.batches] == ["video", "image"]
    assert_same(prepared, ref)


def test_long_side_bound_keeps_the_long_side_within_the_hint_unless_min_pixels_enlarges() -> None:
    rng = random.Random(7)
    for factor, min_pixels, max_pixels in ((28, 3136, 12845056), (32, 65536, 16777216)):
        for _ in range(4000):
            h, w = rng.randint(1, 3000), rng.randint(1, 3000)
            if max(h, w) / min(h, w) > 150:
                continue
            long_side = factor * rng.randint(1, 60)

            def resize(bound: int, h: int = h, w: int = w, f: int = factor, low: int = min_pixels) -> tuple[int, int]:
                return geometry.smart_resize(h, w, f, low, bound)

            rh, rw = resize(long_side_bound(resize, h, w, long_side, max_pixels))
            enlarged = round(h / factor) * factor * round(w / factor) * factor < min_pixels
            assert max(rh, rw) <= long_side or enlarged, (h, w, long_side, rh, rw)


@pytest.fixture(scope="module")
def qwen3_gateway() -> Iterator[str]:
    with loopback_gateway(QWEN3) as base:
        yield base


@pytest.mark.parametrize("part", [
    {"type": "video_url", "video_url": {"url": "URL", "fps": 0.1}},
    {"type": "video_url", "video_url": {"url": "URL", "fps": 5.5}},
    {"type": "video_url", "video_url": {"url": "URL", "max_long_side_pixel": 0}},
    {"type": "video_url", "video_url": {"url": "URL", "max_long_side_pixel": -32}},
    {"type": "video_url", "video_url": {"url": "URL", "max_long_side_pixel": 100}},  # not a multiple of 32
    {"type": "image_url", "image_url": {"url": "URL", "max_long_side_pixel": 28}},  # Qwen3's factor is 32
    {"type": "video_url", "video_url": {"url": "URL", "fps": "2"}},
], ids=["fps-low", "fps-high", "long-zero", "long-negative", "long-off-grid", "image-long-off-grid", "fps-string"])
def test_bad_hint_is_400_invalid_request_before_any_fetch(qwen3_gateway: str, part: dict) -> None:
    with media_origin() as origin:
        url = origin.add("/clip.mp4", b"never fetched", "video/mp4")
        key = "video_url" if part["type"] == "video_url" else "image_url"
        part = {**part, key: {**part[key], "url": url}}
        body = {"model": QWEN3, "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]}
        resp = httpx.post(qwen3_gateway + "/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "invalid_request"
        assert sum(origin.settled().values()) == 0
