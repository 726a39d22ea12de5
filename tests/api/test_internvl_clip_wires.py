"""InternVL3 clips through HTTP: taken by vLLM workers only, refused before any fetch elsewhere.

Real parts: the gateway app on loopback (``gateway_in_thread``) with the InternVL3-1B bundle, loopback
fakes of the TokenSpeed wire (tests/support/fake_engines.py: discovery, and ``Generate`` counted) and of
the vLLM wire (tests/support/fake_worker.py: records what it receives), and a loopback media origin whose
``settled()`` hits show whether anything was fetched.

The spec (docs/families.md, InternVL3; :mod:`mmgate.engines.capabilities`, third axis): an InternVL clip's
context ids are vLLM's ``<video>`` (151674, past the checkpoint's embedding table), which only a vLLM
worker embeds; the family says so (``Family.vllm_video_ids``).  So with only TokenSpeed workers an
InternVL clip is 400 ``multimodal_not_supported`` before anything is fetched or sent; an image of the
same model is still fetched and sent to them; a vLLM worker takes the clip, and in a fleet of both the
clip goes to the vLLM worker only.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.config.settings import FetchSettings, Settings
from tests.conftest import bundle_dir
from tests.support.fake_engines import FakeEngine, FakeEngineState
from tests.support.fake_worker import FakeWorker, FakeWorkerState
from tests.support.servers import MediaOrigin, gateway_in_thread, media_origin
from mmgate.types import Modality
from tests.video.video_support import ClipSpec, make_clip, pipeline

MODEL = "OpenGVLab/InternVL3-1B-hf"
VIDEO_ID = 151674  # vLLM's <video> context id


def png() -> bytes:
    arr = np.random.default_rng(5).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def settings(*urls: str) -> Settings:
    return Settings(model=str(bundle_dir(MODEL)), served_model_name=MODEL, worker_urls=urls,
                    fetch=FetchSettings(allow_private_hosts=True), worker_health_interval_s=0.2)


def chat(part: dict) -> dict:
    return {"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]}


def video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=60)


def wait_healthy(base: str, count: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = httpx.get(base + "/workers", timeout=10).json()["workers"]
        if len(workers) == count and all(w["healthy"] and w["labels"].get("supports_vision") == "true"
                                         for w in workers):
            return
        time.sleep(0.05)
    raise AssertionError(f"workers never all healthy: {httpx.get(base + '/workers', timeout=10).json()}")


@pytest.fixture(scope="module")
def origin() -> Iterator[MediaOrigin]:
    with media_origin() as o:
        yield o


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path: Path = make_clip(ClipSpec("ivl-wires", 4, 8, 64, 48), tmp_path_factory.mktemp("ivl-clip"))
    return path.read_bytes()


def test_the_family_says_its_clips_carry_vllms_ids_and_a_text_level_update() -> None:
    """What the refusals ask of the family, checked against what it does: its clip placeholder is vLLM's
    ``<video>`` and its clip update is text (its images: token ids)."""
    family = pipeline(MODEL).runtime.family
    assert family is not None and family.vllm_video_ids and family.text_updates == frozenset({Modality.VIDEO})
    assert family.video is not None and family.video.placeholder_token_id == VIDEO_ID


def tokenspeed() -> FakeEngine:
    return FakeEngine("tokenspeed", FakeEngineState(model_type="internvl", supported_modalities=("image", "video")))


def test_internvl_clip_on_tokenspeed_is_refused_before_any_fetch(origin: MediaOrigin, clip: bytes) -> None:
    worker = tokenspeed()
    try:
        with gateway_in_thread(settings(worker.url)) as base:
            wait_healthy(base, 1)
            resp = post(base, chat(video(origin.add("/ivl-ts-refused.mp4", clip, "video/mp4"))))
    finally:
        worker.stop()
    assert resp.status_code == 400, resp.text
    assert resp.headers["X-SMG-Error-Code"] == "multimodal_not_supported"
    error = resp.json()["error"]
    assert error["code"] == "multimodal_not_supported" and error["param"] == "messages[0].content[0]"
    assert "tokenspeed" in error["message"] and "vllm" in error["message"], error
    assert "capability matrix" in error["message"], error
    assert worker.state.calls["Generate"] == 0
    assert "/ivl-ts-refused.mp4" not in origin.settled()


def test_internvl_image_on_tokenspeed_is_still_fetched_and_sent(origin: MediaOrigin) -> None:
    worker = tokenspeed()
    try:
        with gateway_in_thread(settings(worker.url)) as base:
            wait_healthy(base, 1)
            resp = post(base, chat(image(origin.add("/ivl-ts-image.png", png(), "image/png"))))
    finally:
        worker.stop()
    # The fake answers Generate UNIMPLEMENTED: what follows the send is not this test's.
    assert resp.headers.get("X-SMG-Error-Code") != "multimodal_not_supported", resp.text
    assert origin.settled()["/ivl-ts-image.png"] == 1
    assert worker.state.calls["Generate"] == 1


def test_internvl_clip_on_vllm_is_taken(origin: MediaOrigin, clip: bytes) -> None:
    worker = FakeWorker(FakeWorkerState(model_type="internvl"))
    try:
        with gateway_in_thread(settings(worker.url)) as base:
            wait_healthy(base, 1)
            resp = post(base, chat(video(origin.add("/ivl-vllm.mp4", clip, "video/mp4"))))
    finally:
        worker.stop()
    assert resp.status_code == 200, resp.text
    assert origin.settled()["/ivl-vllm.mp4"] == 1
    (received,) = worker.state.received
    assert VIDEO_ID in received.input_ids and "video_num_patches" in received.tensors


def test_in_a_mixed_fleet_internvl_clips_go_to_the_vllm_worker_only(origin: MediaOrigin, clip: bytes) -> None:
    ts, vllm = tokenspeed(), FakeWorker(FakeWorkerState(model_type="internvl"))
    try:
        with gateway_in_thread(settings(ts.url, vllm.url)) as base:
            wait_healthy(base, 2)
            for i in range(4):
                resp = post(base, chat(video(origin.add(f"/ivl-mixed-{i}.mp4", clip, "video/mp4"))))
                assert resp.status_code == 200, resp.text
            clips_on_tokenspeed = ts.state.calls["Generate"]
            taken = post(base, chat(image(origin.add("/ivl-mixed.png", png(), "image/png"))))
    finally:
        ts.stop()
        vllm.stop()
    assert len(vllm.state.received) >= 4
    assert all(VIDEO_ID in r.input_ids for r in vllm.state.received[:4])
    assert taken.headers.get("X-SMG-Error-Code") != "multimodal_not_supported", taken.text
    assert clips_on_tokenspeed == 0  # the image may go to either worker
