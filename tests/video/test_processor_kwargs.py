"""Qwen2-VL / Qwen2.5-VL ``mm_processor_kwargs``: the video processor's own kwargs, with the reference's meaning.

Expected values come from the transformers 5.24 processor called with the kwargs flat, as a vLLM
worker passes a request's ``mm_processor_kwargs`` (``Qwen2VLProcessor.__call__`` hands each to every
modality that declares it: ``min_pixels`` / ``max_pixels`` to images and videos, the sampling ones to
videos).  Under the default ``--video-frame-sampling vllm`` the reference call adds what vLLM's video
loader does (``do_sample_frames=True, fps=2``) unless the request names its own ``fps`` or
``num_frames`` (written out per case).  Refusals: the reference's own errors (``fps`` with
``num_frames``, ``num_frames`` past the clip, a count that rounds to no frame) and mmgate's bounds,
400 ``invalid_request`` naming ``mm_processor_kwargs.<name>``; those that need no clip before any fetch.
"""

from __future__ import annotations

import base64
import io
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.backend import FrameSampling
from tests.support.servers import media_origin
from tests.video.video_support import (
    QWEN2,
    QWEN2_5,
    QWEN3,
    assert_same,
    loopback_gateway,
    prepare,
    processor,
    reference,
    video_part,
)

VLLM, TRANSFORMERS = FrameSampling.VLLM, FrameSampling.TRANSFORMERS


def _png(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _image_part(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


#: (model, setting, request kwargs, the reference call's flat kwargs, frames the reference keeps of f60_30fps)
CASES = [
    (QWEN2_5, VLLM, {"do_sample_frames": False}, {}, 60),
    (QWEN2_5, VLLM, {"fps": 5}, {"do_sample_frames": True, "fps": 5}, 10),  # 60 / 30 * 5
    (QWEN2_5, TRANSFORMERS, {"fps": 5}, {"fps": 5}, 60),  # no do_sample_frames: the processor ignores fps
    (QWEN2_5, TRANSFORMERS, {"do_sample_frames": True, "fps": 4}, {"do_sample_frames": True, "fps": 4}, 8),
    (QWEN2_5, VLLM, {"num_frames": 6}, {"do_sample_frames": True, "num_frames": 6}, 6),  # replaces vLLM's rate
    (QWEN2_5, VLLM, {"num_frames": 7}, {"do_sample_frames": True, "num_frames": 7}, 8),  # round(7 / 2) * 2
    (QWEN2, VLLM, {"min_frames": 8}, {"do_sample_frames": True, "fps": 2, "min_frames": 8}, 8),
    (QWEN2_5, VLLM, {"max_frames": 2}, {"do_sample_frames": True, "fps": 2, "max_frames": 2}, 2),
    (QWEN2_5, VLLM, {"do_sample_frames": True}, {"do_sample_frames": True, "fps": 2}, 4),
]


@pytest.mark.parametrize(("model", "sampling", "kwargs", "flat", "frames"), CASES,
                         ids=[f"{m.split('/')[1]}-{s.value}-{'-'.join(k)}" for m, s, k, _, _ in CASES])
def test_sampling_kwargs_sample_as_the_processor_called_with_them(model: str, sampling: FrameSampling, kwargs: dict,
                                                                  flat: dict, frames: int,
                                                                  clips: dict[str, Path]) -> None:
    path = clips["f60_30fps"]
    ref = reference(model, path, flat={"cap_pixels_per_frame": False, **flat})
    assert len(ref.indices) == frames
    assert_same(prepare(model, [video_part(path)], sampling=sampling, kwargs=kwargs), ref)


@pytest.mark.parametrize(("model", "sampling", "bounds", "flat", "clip"), [
    (QWEN2_5, VLLM, {"min_pixels": 200_000, "max_pixels": 300_000}, {"do_sample_frames": True, "fps": 2},
     "f17_25fps_mpeg4"),  # 70x46: enlarged
    (QWEN2, TRANSFORMERS, {"max_pixels": 5000}, {}, "f60_30fps"),  # 160x90: shrunk
], ids=["qwen2_5-vllm-min-max", "qwen2-transformers-max"])
def test_pixel_bounds_apply_to_images_and_videos_as_the_processor_hands_them_to_both(
        model: str, sampling: FrameSampling, bounds: dict, flat: dict, clip: str, clips: dict[str, Path]) -> None:
    path, png = clips[clip], _png(300, 420)
    ref = reference(model, path, images=[Image.open(io.BytesIO(png))],
                    flat={"cap_pixels_per_frame": False, **flat, **bounds})
    default = reference(model, path, images=[Image.open(io.BytesIO(png))], flat={"cap_pixels_per_frame": False, **flat})
    assert ref.out["image_grid_thw"].tolist() != default.out["image_grid_thw"].tolist()
    assert ref.out["video_grid_thw"].tolist() != default.out["video_grid_thw"].tolist()
    assert_same(prepare(model, [video_part(path), _image_part(png)], sampling=sampling, kwargs=bounds), ref)


def test_an_image_only_request_takes_the_video_kwargs_and_ignores_them() -> None:
    png = _png(200, 260)
    proc = processor(QWEN2_5)
    content = [{"type": "image"}, {"type": "text", "text": "What happens?"}]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    # fps with num_frames is the video processor's error: a request without a clip never meets it
    kwargs = {"fps": 1, "num_frames": 4, "min_pixels": 100_000}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(text=[prompt], images=[Image.open(io.BytesIO(png))], return_tensors="np", **kwargs)
    prepared = prepare(QWEN2_5, [_image_part(png)], kwargs=kwargs)
    assert prepared.input_ids == tuple(int(t) for t in out["input_ids"][0])
    (batch,) = prepared.batches
    assert np.array_equal(batch.tensors["pixel_values"], out["pixel_values"])
    assert np.array_equal(batch.tensors["image_grid_thw"], out["image_grid_thw"])


@pytest.mark.parametrize(("kwargs", "flat", "raised"), [
    ({"num_frames": 70}, {}, ValueError),  # "Video can't be sampled": 70 > 60 frames
    ({"num_frames": 1}, {}, ZeroDivisionError),  # round(1 / 2) * 2 = 0 frames
    ({"max_frames": 1}, {"fps": 2}, ZeroDivisionError),  # floor(min(1, 60) / 2) * 2 = 0 frames
], ids=["num-frames-past-the-clip", "num-frames-rounds-to-none", "max-frames-below-a-patch"])
def test_kwargs_the_reference_cannot_sample_a_clip_with_are_400(kwargs: dict, flat: dict, raised: type,
                                                                clips: dict[str, Path]) -> None:
    path = clips["f60_30fps"]
    with pytest.raises(raised):
        reference(QWEN2_5, path, flat={"cap_pixels_per_frame": False, "do_sample_frames": True, **flat, **kwargs})
    with pytest.raises(GatewayError) as err:
        prepare(QWEN2_5, [video_part(path)], kwargs=kwargs)
    assert err.value.code is ErrorCode.INVALID_REQUEST and err.value.status == 400
    assert err.value.param == "messages[0].content[0]"


def test_do_sample_frames_without_a_rate_is_400_where_the_processor_has_none(clips: dict[str, Path]) -> None:
    """transformers' default for these bundles has no fps: ``do_sample_frames=True`` alone raises TypeError
    there (under vllm, vLLM's rate applies: the CASES above)."""
    path = clips["f60_30fps"]
    with pytest.raises(TypeError):
        reference(QWEN2_5, path, flat={"cap_pixels_per_frame": False, "do_sample_frames": True})
    with pytest.raises(GatewayError) as err:
        prepare(QWEN2_5, [video_part(path)], sampling=TRANSFORMERS, kwargs={"do_sample_frames": True})
    assert err.value.status == 400 and err.value.param == "mm_processor_kwargs.do_sample_frames"


def test_qwen3_still_takes_no_mm_processor_kwargs(clips: dict[str, Path]) -> None:
    with pytest.raises(GatewayError) as err:
        prepare(QWEN3, [video_part(clips["f60_30fps"])], kwargs={"fps": 1})
    assert err.value.status == 400 and err.value.param == "mm_processor_kwargs"


@pytest.fixture(scope="module")
def qwen2_5_gateway() -> Iterator[str]:
    with loopback_gateway(QWEN2_5) as base:
        yield base


@pytest.mark.parametrize(("kwargs", "hint", "param"), [
    ({"fps": 1, "num_frames": 4}, None, "num_frames"),  # the reference's ValueError: mutually exclusive
    ({"num_frames": 4}, 1.0, "num_frames"),  # video_url.fps is do_sample_frames=True, fps=1
    ({"nonsense": 1}, None, "nonsense"),
    ({"fps": "2"}, None, "fps"),
    ({"num_frames": 8.0}, None, "num_frames"),
    ({"num_frames": True}, None, "num_frames"),
    ({"do_sample_frames": 1}, None, "do_sample_frames"),
    ({"fps": 0}, None, "fps"),
    ({"fps": -2.0}, None, "fps"),
    ({"num_frames": 0}, None, "num_frames"),
    ({"min_frames": 0}, None, "min_frames"),
    ({"min_pixels": 0}, None, "min_pixels"),
    ({"max_pixels": 16384 * 28 * 28 + 1}, None, "max_pixels"),
], ids=["fps-and-num-frames", "hint-and-num-frames", "unknown", "fps-string", "num-frames-float", "num-frames-bool",
        "do-sample-int", "fps-zero", "fps-negative", "num-frames-zero", "min-frames-zero", "min-pixels-zero",
        "max-pixels-huge"])
def test_bad_kwargs_are_400_naming_the_kwarg_before_any_fetch(qwen2_5_gateway: str, kwargs: dict, hint: float | None,
                                                              param: str) -> None:
    with media_origin() as origin:
        url = origin.add("/clip.mp4", b"never fetched", "video/mp4")
        part = {"type": "video_url", "video_url": {"url": url, **({"fps": hint} if hint else {})}}
        body = {"model": QWEN2_5, "mm_processor_kwargs": kwargs,
                "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]}
        resp = httpx.post(qwen2_5_gateway + "/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_request", f"mm_processor_kwargs.{param}")
        assert sum(origin.hits.values()) == 0
