"""An engine that ends a request early never makes a finished answer.

The CI run of 9dcd112 failed the long fault soak with one ``200`` whose completion was two tokens of three:
the decode engine was stopped mid-generation (``RunningEngine.stop``), its cancelled leg ended with a
``GenerateComplete`` of ``finish_reason`` ``abort``, and the gateway answered that as a finished choice
(``abort`` -> ``stop``).  Now (a) the gateway never sends ``Abort`` (it cancels its call), so an aborted
choice it reads is the engine's own doing: a retryable ``503 engine_unavailable`` before the answer, an
``error`` event with that code in a started stream, never a finish; (b) a stopping reference engine breaks
its streams off with ``UNAVAILABLE``, as a dying engine's connection does.

Real parts: the reference engine in process on loopback (vLLM wire, shrunken Qwen2-VL), the gateway in a
thread (uvicorn), the wire's own ``Abort`` RPC.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.config.settings import FetchSettings, Settings
from mmgate.errors import ERROR_TABLE, ErrorCode
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from tests.refengine.refengine_support import QWEN2_VL, require_bundle
from tests.support.servers import gateway_in_thread

MODEL = "qwen2-vl-abort"
LONG = 4000  # tokens: far more than the test waits for


@pytest.fixture
def stack() -> Iterator[tuple[RunningEngine, str]]:
    """A fresh engine (a test may stop it) and a gateway over it."""
    bundle: Path = require_bundle(QWEN2_VL)
    engine = start_engine(EngineConfig(model=bundle, port=0, max_tokens_default=16))
    settings = Settings(model=str(bundle), served_model_name=MODEL, worker_urls=(f"grpc://{engine.address}",),
                        fetch=FetchSettings())
    try:
        with gateway_in_thread(settings) as base:
            yield engine, base
    finally:
        engine.stop(grace=0)


def _body(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": LONG, "ignore_eos": True, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": "Count."}]}


def _running_id(engine: RunningEngine, timeout_s: float = 30.0) -> str:
    """The id of the one request the engine runs, once it runs one."""
    deadline = time.monotonic() + timeout_s
    while not (ids := engine.core.active_ids()):
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    assert len(ids) == 1
    return ids[0]


def _abort(engine: RunningEngine, request_id: str) -> None:
    with grpc.insecure_channel(engine.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=[request_id]), timeout=5)


def _assert_retryable_503(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text[:300]
    assert resp.headers["X-SMG-Error-Code"] == ErrorCode.ENGINE_UNAVAILABLE.value
    assert resp.json()["error"]["code"] == ErrorCode.ENGINE_UNAVAILABLE.value
    assert ERROR_TABLE[ErrorCode.ENGINE_UNAVAILABLE].retryable and resp.headers.get("Retry-After")


def _events(resp: httpx.Response) -> Iterator[dict[str, Any] | str]:
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def _rest_of_stream(events: Iterator[dict[str, Any] | str]) -> tuple[list[str | None], list[dict[str, Any]], bool]:
    """(finish reasons seen, error objects seen, whether ``[DONE]`` ended it)."""
    finishes: list[str | None] = []
    errors: list[dict[str, Any]] = []
    for event in events:
        if event == "[DONE]":
            return finishes, errors, True
        assert isinstance(event, dict)
        if "error" in event:
            errors.append(event["error"])
        finishes += [c["finish_reason"] for c in event.get("choices", []) if c.get("finish_reason")]
    return finishes, errors, False


def _first_content_chunk(events: Iterator[dict[str, Any] | str]) -> dict[str, Any]:
    for event in events:
        assert isinstance(event, dict) and "error" not in event, event
        if any(c["delta"].get("content") for c in event["choices"]):
            return event
    raise AssertionError("the stream ended before any content")


def test_an_engine_abort_before_the_answer_is_a_retryable_503(stack: tuple[RunningEngine, str]) -> None:
    engine, base = stack
    got: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: got.append(
        httpx.post(f"{base}/v1/chat/completions", json=_body(stream=False), timeout=120)))
    sender.start()
    _abort(engine, _running_id(engine))
    sender.join(timeout=120)
    assert got, "the request did not return"
    _assert_retryable_503(got[0])
    # the engine is fine: the next request is answered whole
    whole = httpx.post(f"{base}/v1/chat/completions", json={**_body(stream=False), "max_tokens": 3}, timeout=60)
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 3


def test_an_engine_abort_mid_stream_is_an_error_event_never_a_finish(stack: tuple[RunningEngine, str]) -> None:
    engine, base = stack
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=_body(stream=True), timeout=120) as resp:
        assert resp.status_code == 200
        events = _events(resp)
        first = _first_content_chunk(events)
        assert engine.core.active_ids() == (first["id"],)  # the engine runs it under the answer's id
        _abort(engine, first["id"])
        finishes, errors, done = _rest_of_stream(events)
    assert finishes == [] and done
    assert [e["code"] for e in errors] == [ErrorCode.ENGINE_UNAVAILABLE.value]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_engine_stopped_mid_generation_is_never_a_finished_answer(stack: tuple[RunningEngine, str],
                                                                     stream: bool) -> None:
    """The soak's case: the engine stopped (``grace=0``) while it generates."""
    engine, base = stack
    if not stream:
        got: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: got.append(
            httpx.post(f"{base}/v1/chat/completions", json=_body(stream=False), timeout=120)))
        sender.start()
        _running_id(engine)
        deadline = time.monotonic() + 30
        while engine.core.counts()[1] == 0:  # on a model thread: generating, not queued
            assert time.monotonic() < deadline, "the request never started generating"
            time.sleep(0.01)
        time.sleep(0.1)  # some tokens generated
        engine.stop(grace=0)
        sender.join(timeout=120)
        assert got, "the request did not return"
        _assert_retryable_503(got[0])
        return
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=_body(stream=True), timeout=120) as resp:
        assert resp.status_code == 200
        events = _events(resp)
        _first_content_chunk(events)
        engine.stop(grace=0)
        finishes, errors, done = _rest_of_stream(events)
    assert finishes == [] and done
    assert [e["code"] for e in errors] == [ErrorCode.ENGINE_UNAVAILABLE.value]
