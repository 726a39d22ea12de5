"""Audio intake through HTTP: the parts are parsed, and refused before any fetch where they cannot be served.

* A model whose family has no audio processor (Qwen2.5-VL) refuses ``input_audio`` and ``audio_url``
  (chat), ``input_audio`` (Responses) with ``multimodal_not_supported`` (400), naming the part, and the
  media origin sees no request; an Anthropic audio block is refused by name.
* The engine x modality matrix for audio (issue 23): the same model served with an audio processor added
  (a stand-in: no audio family exists yet) is refused router-side audio on a vLLM or an SGLang worker
  (``multimodal_not_supported``, "capability matrix", no fetch); a TokenSpeed worker passes the check.

Real parts: the gateway app on loopback, fake workers of each wire (tests/support), a loopback media
origin that counts hits.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import pytest

from mmgate.config.settings import FetchSettings, MmProcessing, Settings
from mmgate.engines.base import Wire
from mmgate.gateway import state as state_module
from mmgate.types import Modality, TensorLayout, TensorSpec
from tests.conftest import bundle_dir
from tests.support.fake_engines import FakeEngine, FakeEngineState
from tests.support.fake_worker import FakeWorker, FakeWorkerState
from tests.support.servers import MediaOrigin, gateway_in_thread, media_origin
from tests.worker_mode.support import MODEL as REFS_MODEL
from tests.worker_mode.support import FakeEngine as RefsEngine
from tests.worker_mode.support import wait_for

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
WAV = base64.b64encode(b"RIFF" + b"\x00" * 40).decode()


def settings(*urls: str, mode: MmProcessing = MmProcessing.AUTO, model: str = MODEL) -> Settings:
    return Settings(model=str(bundle_dir(model)), worker_urls=urls, fetch=FetchSettings(allow_private_hosts=True),
                    worker_health_interval_s=0.2, sglang_allow_mrope_media=True, mm_processing=mode)


def chat(*parts: dict) -> dict:
    return {"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Listen."}, *parts]}]}


def post(base: str, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=30)


class StandInAudio:
    """An audio processor by the protocol's attributes only: the matrix refuses before it is ever asked
    to plan (anything past the attributes would fail the test loudly)."""

    modality = Modality.AUDIO
    specs = (TensorSpec("input_features", "float32", TensorLayout.FLAT, primary=True),)
    device_normalizable = False
    sampling_rate = 16000
    anchor_token_id = 151646
    placeholder_token_id = 151646
    fingerprint = "stand-in-audio"

    def check_hints(self, hints: object, param: str) -> None:
        return None


class WithAudio:
    """``family`` with :class:`StandInAudio` in its processors and an audio item limit."""

    def __init__(self, family: Any) -> None:
        self._family = family
        self.processors: Mapping[Modality, Any] = {**family.processors, Modality.AUDIO: StandInAudio()}
        self.limits = {**family.limits, Modality.AUDIO: 4}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._family, name)


@pytest.fixture(scope="module")
def origin() -> Iterator[MediaOrigin]:
    with media_origin() as o:
        yield o


@pytest.fixture(scope="module")
def plain() -> Iterator[str]:
    """Qwen2.5-VL (no audio processor) over a vLLM fake."""
    worker = FakeWorker(FakeWorkerState(model_type="qwen2_5_vl"))
    try:
        with gateway_in_thread(settings(worker.url)) as base:
            yield base
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def with_audio() -> Iterator[dict[Any, str]]:
    """The same model with an audio processor, one gateway per wire (router-side processing), and a vLLM
    gateway under ``--mm-processing auto`` whose worker advertises a media processor (``vllm-refs``)."""
    real = state_module.load_family
    state_module.load_family = lambda *a, **k: WithAudio(real(*a, **k))  # type: ignore[assignment]
    vllm = FakeWorker(FakeWorkerState(model_type="qwen2_5_vl"))
    sglang = FakeEngine("sglang")
    tokenspeed = FakeEngine("tokenspeed", FakeEngineState(supported_modalities=("image", "video", "audio")))
    refs = RefsEngine(processor="inprocess", schemes="data,http,https").start()
    try:
        with gateway_in_thread(settings(vllm.url, mode=MmProcessing.ROUTER)) as b1, \
                gateway_in_thread(settings(sglang.url, mode=MmProcessing.ROUTER)) as b2, \
                gateway_in_thread(settings(tokenspeed.url, mode=MmProcessing.ROUTER)) as b3, \
                gateway_in_thread(settings(refs.url, model=REFS_MODEL)) as b4:
            wait_for(lambda: httpx.get(b4 + "/workers", timeout=5).json()["workers"][0]["labels"].get(
                "mm_processor") == "inprocess", 30, "mm_processor=inprocess")
            yield {Wire.VLLM: b1, Wire.SGLANG: b2, Wire.TOKENSPEED: b3, "vllm-refs": b4}
    finally:
        state_module.load_family = real
        for worker in (vllm, sglang, tokenspeed, refs):
            worker.stop()


def refused(resp: httpx.Response, code: str, param: str | None) -> dict:
    assert resp.status_code == 400, resp.text
    assert resp.headers["X-SMG-Error-Code"] == code, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    return error


def test_input_audio_to_a_model_without_audio_is_400_multimodal_not_supported(plain: str) -> None:
    resp = post(plain, chat({"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}}))
    error = refused(resp, "multimodal_not_supported", "messages[0].content[1]")
    assert "audio" in error["message"] and WAV not in resp.text


def test_audio_url_to_a_model_without_audio_is_refused_before_any_fetch(plain: str, origin: MediaOrigin) -> None:
    url = origin.add("/no-audio-model.wav", b"RIFF" + b"\x00" * 40, "audio/wav")
    resp = post(plain, chat({"type": "audio_url", "audio_url": {"url": url}}))
    refused(resp, "multimodal_not_supported", "messages[0].content[1]")
    assert origin.settled()["/no-audio-model.wav"] == 0


def test_an_input_audio_format_outside_the_taken_set_is_400_naming_the_field(plain: str) -> None:
    resp = post(plain, chat({"type": "input_audio", "input_audio": {"data": WAV, "format": "midi"}}))
    error = refused(resp, "invalid_request", "messages[0].content[1].input_audio.format")
    assert "midi" not in error["message"]  # the caller's value is never echoed


def test_responses_input_audio_is_parsed_and_refused_for_a_model_without_audio(plain: str) -> None:
    body = {"model": MODEL, "max_output_tokens": 1, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Listen."},
        {"type": "input_audio", "input_audio": {"data": WAV, "format": "mp3"}}]}]}
    resp = post(plain, body, "/v1/responses")
    assert resp.status_code == 400 and resp.headers["X-SMG-Error-Code"] == "multimodal_not_supported", resp.text


def test_anthropic_audio_blocks_are_refused_by_name(plain: str) -> None:
    for kind in ("audio", "input_audio"):
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Listen."}, {"type": kind, "source": {"data": WAV}}]}]}
        resp = post(plain, body, "/v1/messages")
        assert resp.status_code == 400 and resp.headers["X-SMG-Error-Code"] == "multimodal_not_supported", resp.text
        assert "no audio" in resp.text


@pytest.mark.parametrize("wire", [Wire.VLLM, Wire.SGLANG], ids=["vllm", "sglang"])
def test_router_side_audio_to_a_vllm_or_sglang_worker_is_refused_by_the_matrix_before_any_fetch(
        with_audio: dict[Wire, str], origin: MediaOrigin, wire: Wire) -> None:
    path = f"/matrix-{wire.value}.wav"
    url = origin.add(path, b"RIFF" + b"\x00" * 40, "audio/wav")
    resp = post(with_audio[wire], chat({"type": "audio_url", "audio_url": {"url": url}}))
    error = refused(resp, "multimodal_not_supported", "messages[0].content[1]")
    assert "capability matrix" in error["message"], error
    assert origin.settled()[path] == 0


def test_a_tokenspeed_worker_passes_the_matrix_check_for_audio(with_audio: dict[Wire, str]) -> None:
    """The control: the TokenSpeed row has audio, so the refusal (if any) comes from a later stage (here the
    stand-in processor's anchor, which Qwen2.5-VL's template never renders), not from the matrix."""
    resp = post(with_audio[Wire.TOKENSPEED], chat({"type": "input_audio", "input_audio": {"data": WAV}}))
    assert resp.headers.get("X-SMG-Error-Code") != "multimodal_not_supported", resp.text
    assert "capability matrix" not in resp.text


def test_audio_to_a_vllm_worker_goes_as_a_media_reference_on_the_worker_path(with_audio: dict[Any, str]) -> None:
    """``--mm-processing auto`` with a worker that processes references: the audio part is forwardable, so it
    takes the worker path, whose own checks answer (here the one anchor check: the stand-in's anchor is not in
    Qwen2.5-VL's template), not the router-side matrix refusal."""
    body = {**chat({"type": "input_audio", "input_audio": {"data": WAV}}), "model": REFS_MODEL}
    resp = post(with_audio["vllm-refs"], body)
    assert resp.status_code == 400 and resp.headers["X-SMG-Error-Code"] == "media_count_mismatch", resp.text
    assert "0 audio anchors for 1 audios" in resp.json()["error"]["message"]
