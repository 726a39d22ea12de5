"""The capability matrix through HTTP: media no registered worker takes is refused before any fetch.

One gateway per wire (Qwen2.5-VL, a family that takes images and video), its one worker a loopback
fake of that wire (vLLM: tests/support/fake_worker.py; SGLang, TokenSpeed: tests/support/fake_engines.py,
discovery only).  The gateway detects each worker's wire by itself (no flag).  Every request carries,
next to the part under test, an image URL on a loopback media origin: a refusal that came after any
fetch would show as a hit there.

The pairs refused are the complement of :data:`mmgate.engines.capabilities.MATRIX`, which is read
from the servicers (see that module): vLLM takes image and video, SGLang image, TokenSpeed image,
video and audio; no wire takes image embeddings.  Audio is refused for every wire here by the
family as well (no registered family takes audio), still before any fetch.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.engines.base import Wire
from mmgate.engines.capabilities import MATRIX, MediaKind
from mmgate.config.settings import FetchSettings, Settings
from tests.conftest import bundle_dir
from tests.support.fake_engines import FakeEngine, FakeEngineState
from tests.support.fake_worker import FakeWorker, FakeWorkerState
from tests.support.servers import MediaOrigin, gateway_in_thread, media_origin

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
#: wire x kind pairs the matrix refuses, written out (the spec); the test checks the matrix agrees
UNSUPPORTED = [
    (Wire.VLLM, MediaKind.AUDIO), (Wire.VLLM, MediaKind.IMAGE_EMBEDS),
    (Wire.SGLANG, MediaKind.VIDEO), (Wire.SGLANG, MediaKind.AUDIO), (Wire.SGLANG, MediaKind.IMAGE_EMBEDS),
    (Wire.TOKENSPEED, MediaKind.IMAGE_EMBEDS),
]


def png() -> bytes:
    arr = np.random.default_rng(7).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def part(kind: MediaKind, origin: MediaOrigin, tag: str) -> dict:
    """A content part of ``kind``; URL parts point at the origin (path unique to the test)."""
    if kind is MediaKind.IMAGE:
        return {"type": "image_url", "image_url": {"url": origin.add(f"/{tag}.png", png(), "image/png")}}
    if kind is MediaKind.VIDEO:
        return {"type": "video_url", "video_url": {"url": origin.add(f"/{tag}.mp4", b"\x00" * 64, "video/mp4")}}
    if kind is MediaKind.AUDIO:
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF" + b"\x00" * 40).decode(),
                                                       "format": "wav"}}
    return {"type": "image_embeds", "image_embeds": base64.b64encode(b"\x00" * 64).decode()}


def chat(*parts: dict) -> dict:
    return {"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]}


def post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=30)


def workers(base: str) -> list[dict]:
    return httpx.get(base + "/workers", timeout=10).json()["workers"]


def wait_labels(base: str, want: dict[str, str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(all(w["labels"].get(k) == v for k, v in want.items()) for w in workers(base)):
            return
        time.sleep(0.05)
    raise AssertionError(f"labels never became {want}: {[w['labels'] for w in workers(base)]}")


def settings(*urls: str) -> Settings:
    """Qwen2.5-VL positions media with M-RoPE, which SGLang workers lose: the SGLang gateways here opt in
    (``--sglang-allow-mrope-media``), since this file is about the matrix's wire x kind axis
    (tests/api/test_sglang_mrope.py has the positions axis)."""
    return Settings(model=str(bundle_dir(MODEL)), worker_urls=urls, fetch=FetchSettings(allow_private_hosts=True),
                    worker_health_interval_s=0.2, sglang_allow_mrope_media=True)


class Stack:
    """A gateway over one fake worker of ``wire``; ``vision(False)`` makes the worker language-model-only."""

    def __init__(self, wire: Wire, base: str, state: FakeWorkerState | FakeEngineState) -> None:
        self.wire, self.base, self.state = wire, base, state

    def vision(self, on: bool) -> None:
        self.state.supports_vision = on
        wait_labels(self.base, {"supports_vision": str(on).lower()})


@pytest.fixture(scope="module")
def origin() -> Iterator[MediaOrigin]:
    with media_origin() as o:
        yield o


@pytest.fixture(scope="module")
def stacks() -> Iterator[dict[Wire, Stack]]:
    vllm = FakeWorker(FakeWorkerState(model_type="qwen2_5_vl"))
    sglang = FakeEngine("sglang")
    tokenspeed = FakeEngine("tokenspeed", FakeEngineState(supported_modalities=("image", "video", "audio")))
    try:
        with gateway_in_thread(settings(vllm.url)) as b1, gateway_in_thread(settings(sglang.url)) as b2, \
                gateway_in_thread(settings(tokenspeed.url)) as b3:
            out = {Wire.VLLM: Stack(Wire.VLLM, b1, vllm.state), Wire.SGLANG: Stack(Wire.SGLANG, b2, sglang.state),
                   Wire.TOKENSPEED: Stack(Wire.TOKENSPEED, b3, tokenspeed.state)}
            for stack in out.values():
                wait_labels(stack.base, {"wire": stack.wire.value})
            yield out
    finally:
        for worker in (vllm, sglang, tokenspeed):
            worker.stop()


def test_the_refused_pairs_are_the_complement_of_the_matrix() -> None:
    derived = [(wire, kind) for wire in Wire for kind in MediaKind if kind not in MATRIX[wire]]
    assert sorted(derived) == sorted(UNSUPPORTED)


def test_each_gateway_detected_its_workers_wire_without_a_flag(stacks: dict[Wire, Stack]) -> None:
    for wire, stack in stacks.items():
        (worker,) = workers(stack.base)
        assert worker["healthy"], worker
        assert (worker["labels"]["wire"], worker["labels"]["role"]) == (wire.value, "single")


@pytest.mark.parametrize(("wire", "kind"), UNSUPPORTED, ids=[f"{w.value}-{k.value}" for w, k in UNSUPPORTED])
def test_an_unsupported_pair_is_400_before_anything_is_fetched(
        stacks: dict[Wire, Stack], origin: MediaOrigin, wire: Wire, kind: MediaKind) -> None:
    tag = f"refused-{wire.value}-{kind.value}"
    resp = post(stacks[wire].base, chat(part(MediaKind.IMAGE, origin, tag), part(kind, origin, tag)))
    assert resp.status_code == 400, resp.text
    assert resp.headers["X-SMG-Error-Code"] == "multimodal_not_supported"
    error = resp.json()["error"]
    assert error["param"] == "messages[0].content[1]"
    if kind is not MediaKind.AUDIO:  # audio: the family refuses it first (planning), also before any fetch
        assert "capability matrix" in error["message"], error
    hits = origin.settled()
    assert not any(tag in path for path in hits), hits


@pytest.mark.parametrize("wire", list(Wire), ids=[w.value for w in Wire])
def test_a_language_model_only_worker_of_any_wire_gets_no_image(
        stacks: dict[Wire, Stack], origin: MediaOrigin, wire: Wire) -> None:
    stack = stacks[wire]
    tag = f"lm-only-{wire.value}"
    stack.vision(False)
    try:
        resp = post(stack.base, chat(part(MediaKind.IMAGE, origin, tag)))
    finally:
        stack.vision(True)
    assert resp.status_code == 400 and resp.headers["X-SMG-Error-Code"] == "multimodal_not_supported", resp.text
    assert resp.json()["error"]["param"] == "messages[0].content[0]"
    assert "capability matrix" in resp.json()["error"]["message"]
    hits = origin.settled()
    assert not any(tag in path for path in hits), hits


@pytest.mark.parametrize(("wire", "kind"), [(Wire.VLLM, MediaKind.IMAGE), (Wire.VLLM, MediaKind.VIDEO),
                                            (Wire.SGLANG, MediaKind.IMAGE), (Wire.TOKENSPEED, MediaKind.IMAGE),
                                            (Wire.TOKENSPEED, MediaKind.VIDEO)],
                         ids=["vllm-image", "vllm-video", "sglang-image", "tokenspeed-image", "tokenspeed-video"])
def test_a_supported_pair_passes_the_capability_check(
        stacks: dict[Wire, Stack], origin: MediaOrigin, wire: Wire, kind: MediaKind) -> None:
    """The control: the same gateways fetch what their worker takes (what happens next is not this test's)."""
    tag = f"taken-{wire.value}-{kind.value}"
    resp = post(stacks[wire].base, chat(part(kind, origin, tag)))
    assert resp.headers.get("X-SMG-Error-Code") != "multimodal_not_supported", resp.text
    assert any(tag in path for path in origin.hits), origin.hits
    if (wire, kind) == (Wire.VLLM, MediaKind.IMAGE):
        assert resp.status_code == 200, resp.text


def test_workers_show_each_detected_wire_and_reported_role(origin: MediaOrigin) -> None:
    """A mixed fleet: an SGLang prefill worker, a TokenSpeed encode worker and a vLLM KV consumer."""
    prefill = FakeEngine("sglang", FakeEngineState(server_args={"disaggregation_mode": "prefill"}))
    encode = FakeEngine("tokenspeed", FakeEngineState(server_args={"disaggregation_mode": "encode"}))
    decode = FakeWorker(FakeWorkerState(labels={"kv_role": "kv_consumer"}))
    try:
        with gateway_in_thread(settings(prefill.url, encode.url, decode.url)) as base:
            wait_labels(base, {"supports_vision": "true"})
            got = [(w["url"], w["labels"]["wire"], w["labels"]["role"]) for w in workers(base)]
            assert got == [(prefill.url, "sglang", "prefill"), (encode.url, "tokenspeed", "encode"),
                           (decode.url, "vllm", "decode")]
            # Embeddings: no wire of the fleet takes them; video: the vLLM and TokenSpeed workers do.
            tag = "mixed-fleet"
            refused = post(base, chat(part(MediaKind.IMAGE, origin, tag), part(MediaKind.IMAGE_EMBEDS, origin, tag)))
            assert refused.headers["X-SMG-Error-Code"] == "multimodal_not_supported"
            hits = origin.settled()
            assert not any(tag in path for path in hits), hits
            taken = post(base, chat(part(MediaKind.VIDEO, origin, "mixed-video")))
            assert taken.headers.get("X-SMG-Error-Code") != "multimodal_not_supported", taken.text
    finally:
        for worker in (prefill, encode, decode):
            worker.stop()
