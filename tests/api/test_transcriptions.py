"""``POST /v1/audio/transcriptions`` end to end: the ``openai`` client -> the gateway (loopback, in a thread) ->
the reference engine running Qwen3-ASR on the TokenSpeed wire (in process, recording what its model received).

Every expected value comes from transformers 5.24: the prompt is ``Qwen3ASRProcessor.apply_transcription_request
(audio, language, prompt)`` (its ``input_ids``, ``input_features`` and ``input_features_mask``, compared with the
engine's recording of the request, whose id the gateway's ``X-Request-Id`` names); the text is
``processor.extract_transcription`` of the greedy ids of ``model.generate`` on that output with the engine's seeded
weights (:func:`mmgate.refengine.bundle.load_model`).  Formats ``json`` (with token ``usage``), ``text``,
``verbose_json`` and the SSE stream (``transcript.text.delta`` / ``transcript.text.done``); refusals: an unknown
model (404 ``model_not_found``), a model without audio and no ``file`` (400), a body that is not multipart (415),
an oversized body refused before it is read and an oversized file (413), a bad language (400), and the API key.
"""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from mmgate.config.auth import AuthSettings, key_digest
from mmgate.config.settings import FetchSettings, Settings
from mmgate.engines.base import Wire
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from tests.audio.clips import pcm16_tone, wav16
from tests.conftest import bundle_dir
from tests.support.fake_worker import FakeWorker, FakeWorkerState
from tests.support.servers import gateway_in_thread

ASR = "Qwen--Qwen3-ASR-0.6B"
SR = 16_000
STEPS = 4
KEY = "sk-mmgate-transcriptions-key"
PATH = "/v1/audio/transcriptions"


def pcm16(samples: int, seed: int) -> np.ndarray:
    """A tone plus noise as int16 (tests/audio/clips.py)."""
    return pcm16_tone(samples, seed, 180, 90, SR)


def wav_bytes(pcm: np.ndarray) -> bytes:
    return wav16(pcm, SR)


#: 1.5 s + 37 samples (not a multiple of the hop): 150 valid frames, padded to 200 by the extractor
CLIP = pcm16(24_037, 4)
WAVE = (CLIP.astype(np.float32) / np.float32(32768.0)).astype(np.float32)


@dataclass
class Stack:
    engine: RunningEngine
    record_dir: Path
    base: str
    client: openai.OpenAI

    def recorded(self, request_id: str) -> dict[str, np.ndarray]:
        with np.load(self.record_dir / f"{request_id}.npz") as data:
            return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    record_dir = tmp_path_factory.mktemp("asr-recordings")
    engine = start_engine(EngineConfig(model=bundle_dir(ASR), port=0, wire=Wire.TOKENSPEED, record_dir=record_dir))
    try:
        settings = Settings(model=str(bundle_dir(ASR)), served_model_name="asr",
                            worker_urls=(f"grpc://{engine.address}",), worker_health_interval_s=0.2)
        with gateway_in_thread(settings) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            yield Stack(engine, record_dir, base, client)
    finally:
        engine.stop(grace=0)


@cache
def processor() -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(bundle_dir(ASR)))


def reference(language: str | None, prompt: str | None) -> dict[str, Any]:
    return dict(processor().apply_transcription_request(WAVE, language=language, prompt=prompt,
                                                        processor_kwargs={"sampling_rate": SR}))


@cache
def reference_text(language: str | None, prompt: str | None) -> tuple[str, int]:
    """``extract_transcription`` of the greedy ids, and how many ids."""
    import torch

    from mmgate.refengine.bundle import load_model

    inputs = reference(language, prompt)
    model = load_model(EngineConfig(model=bundle_dir(ASR), port=0)).model  # seed 0, as the engine
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=STEPS, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    return processor().extract_transcription(processor().decode(ids)), len(ids)


def check_recording(stack: Stack, request_id: str, language: str | None, prompt: str | None) -> dict[str, Any]:
    """The engine received the ids and features of ``apply_transcription_request``."""
    ref = reference(language, prompt)
    got = stack.recorded(request_id)
    assert got["input_ids"].tolist() == ref["input_ids"].tolist()
    assert got["input_features"].tobytes() == ref["input_features"].numpy().astype(np.float32).tobytes()
    np.testing.assert_array_equal(got["input_features_mask"], ref["input_features_mask"].numpy())
    return ref


def create(stack: Stack, **kwargs: Any) -> Any:
    return stack.client.audio.transcriptions.with_raw_response.create(
        model="asr", file=("clip.wav", wav_bytes(CLIP), "audio/wav"), temperature=0,
        extra_body={"max_completion_tokens": STEPS}, **kwargs)


@pytest.mark.parametrize(("language", "prompt"), [("en", None), (None, "Qwen, mmgate"), ("Chinese", "")])
def test_json_transcription_is_the_processor_prompt_and_the_model_text(stack: Stack, language: str | None,
                                                                        prompt: str | None) -> None:
    kwargs: dict[str, Any] = {}
    if language is not None:
        kwargs["language"] = language
    if prompt is not None:
        kwargs["prompt"] = prompt
    raw = create(stack, **kwargs)
    assert raw.http_response.status_code == 200
    result = raw.parse()
    ref = check_recording(stack, raw.headers["X-Request-Id"], language, prompt)
    text, generated = reference_text(language, prompt)
    assert result.text == text
    usage = result.usage
    assert usage is not None and usage.type == "tokens"
    assert usage.input_tokens == ref["input_ids"].shape[1]
    assert usage.output_tokens == generated == STEPS
    audio_tokens = int((ref["input_ids"] == 151676).sum())
    assert usage.input_token_details is not None and usage.input_token_details.audio_tokens == audio_tokens


def test_text_and_verbose_json_formats(stack: Stack) -> None:
    want, _ = reference_text("en", None)
    text = create(stack, language="en", response_format="text")
    assert text.http_response.headers["content-type"].startswith("text/plain")
    assert text.http_response.text == want
    verbose = create(stack, language="en", response_format="verbose_json")
    body = verbose.http_response.json()
    assert body["text"] == want and body["language"] == "english" and body["task"] == "transcribe"
    assert body["duration"] == pytest.approx(len(CLIP) / SR)
    assert body["usage"] == {"type": "duration", "seconds": body["duration"]}


def test_streamed_transcription_deltas_join_to_the_done_text(stack: Stack) -> None:
    want, _ = reference_text("en", None)
    events = list(stack.client.audio.transcriptions.create(
        model="asr", file=("clip.wav", wav_bytes(CLIP), "audio/wav"), language="en", temperature=0, stream=True,
        extra_body={"max_completion_tokens": STEPS}))
    assert events and events[-1].type == "transcript.text.done"
    deltas = [e.delta for e in events[:-1]]
    assert all(e.type == "transcript.text.delta" for e in events[:-1])
    assert want and "".join(deltas) == events[-1].text == want
    assert events[-1].usage is not None and events[-1].usage.output_tokens == STEPS


def error_of(resp: httpx.Response, status: int, code: str, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["X-SMG-Error-Code"] == code
    error = resp.json()["error"]
    assert error["code"] == code and error["param"] == param, error
    return error


def post(base: str, fields: dict[str, str], file: bytes | None = b"", headers: dict[str, str] | None = None
         ) -> httpx.Response:
    files = {"file": ("clip.wav", file, "audio/wav")} if file is not None else None
    if files is None:  # a multipart body without a file part
        files = {"model": (None, fields.pop("model", ""))}
    return httpx.post(base + PATH, data=fields, files=files, headers=headers, timeout=60)


def test_refusals_through_the_openai_client(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        stack.client.audio.transcriptions.create(model="no-such-model", file=("clip.wav", wav_bytes(CLIP)))
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as corrupt:
        stack.client.audio.transcriptions.create(model="asr", file=("clip.wav", b"RIFF" + b"\0" * 40))
    assert corrupt.value.code == "audio_decode_failed" and corrupt.value.param == "file"


def test_refusals_through_http(stack: Stack) -> None:
    clip = wav_bytes(CLIP)
    error_of(post(stack.base, {"model": "no-such-model"}, clip), 404, "model_not_found", "model")
    error_of(post(stack.base, {"model": "asr"}, None), 400, "invalid_request", "file")
    error_of(post(stack.base, {"model": "asr", "language": "klingon"}, clip), 400, "invalid_request", "language")
    error_of(post(stack.base, {"model": "asr", "response_format": "srt"}, clip), 400, "invalid_request",
             "response_format")
    error_of(post(stack.base, {"model": "asr", "timestamp_granularities[]": "word"}, clip), 400, "invalid_request",
             "timestamp_granularities[]")
    error_of(post(stack.base, {"model": "asr"}, b"RIFF" + b"\0" * 40), 400, "audio_decode_failed", "file")
    # a field past 64 KiB is refused by the form parser
    error_of(post(stack.base, {"model": "asr", "prompt": "x" * 70_000}, clip), 400, "invalid_request", None)
    # a sampling value the chat path refuses keeps its own name
    error_of(post(stack.base, {"model": "asr", "max_completion_tokens": "0"}, clip), 400, "invalid_request",
             "max_completion_tokens")
    error_of(httpx.post(stack.base + PATH, json={"model": "asr"}, timeout=30), 415, "unsupported_media_type", None)


def test_an_oversized_body_is_refused_before_it_is_read(stack: Stack) -> None:
    """A declared body over the bound gets 413 and the connection is closed; the rest is never sent."""
    host, port = stack.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
                     b"boundary=b\r\nContent-Length: 999999999999\r\n\r\n--b\r\n")
        answer = sock.recv(65536).decode("latin-1")
    assert answer.startswith("HTTP/1.1 413") and "request_too_large" in answer


@pytest.fixture(scope="module")
def plain() -> Iterator[str]:
    """Qwen2.5-VL (no audio) over a fake vLLM worker, a 1 KiB audio cap and an API key."""
    worker = FakeWorker(FakeWorkerState(model_type="qwen2_5_vl"))
    try:
        settings = Settings(model=str(bundle_dir("Qwen/Qwen2.5-VL-7B-Instruct")), worker_urls=(worker.url,),
                            worker_health_interval_s=0.2, fetch=FetchSettings(audio_max_bytes=1024),
                            auth=AuthSettings(api_keys=(key_digest(KEY.encode()),)))
        with gateway_in_thread(settings) as base:
            yield base
    finally:
        worker.stop()


def test_a_model_without_audio_an_oversized_file_and_the_api_key(plain: str) -> None:
    ok = {"Authorization": f"Bearer {KEY}"}
    model = "Qwen/Qwen2.5-VL-7B-Instruct"
    error_of(post(plain, {"model": model}, wav_bytes(CLIP[:400]), ok), 400, "multimodal_not_supported", "model")
    error_of(post(plain, {"model": model}, wav_bytes(CLIP[:4000]), ok), 413, "media_too_large", "file")
    error_of(post(plain, {"model": model}, wav_bytes(CLIP[:400])), 401, "invalid_api_key", None)
