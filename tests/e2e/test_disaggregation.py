"""Prefill/decode disaggregation end to end: gateway process (``mmgate serve --pd-disaggregation``) ->
reference engines (in this process, loopback) of the SGLang and TokenSpeed wires in the prefill and decode
roles (docs/disaggregation.md, docs/refengine-roles.md).

* Greedy, EOS ignored: a PD pair on each wire answers the same completion tokens (each position's token
  bytes from ``logprobs``, and the text) as one single vLLM-wire engine behind a plain gateway, for
  Qwen2.5-VL and Qwen3-VL image requests.
* The pair's room is minted per request, and the prefill engine's handoff store is empty afterwards
  (the decode claimed it).
* Faults: decode worker down -> retryable 503, no ``/dev/shm/mmgate-*`` segment left, no hung request.
* The ``pd_decode_language_model_only_*`` refusals (unit level: :func:`check_pd_request`).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.request.parse import parse_chat_request
from mmgate.engines.base import Capabilities, EncodedRequest, Role, Wire
from mmgate.errors import ErrorCode, GatewayError
from mmgate.cli.launch import Child, start_gateway, wait_http_health
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from mmgate.routing.disagg import (
    ROOM_MAX,
    _encode_call,
    _EncodeFailed,
    check_pd_request,
    mint_room,
    pick_encoder,
)
from mmgate.routing.workers import Worker, WorkerRegistry
from mmgate.config.settings import MmProcessing, parse_settings
from tests.conftest import bundle_dir

QWEN2_5 = "Qwen/Qwen2.5-VL-7B-Instruct"
QWEN3 = "Qwen/Qwen3-VL-2B-Instruct"
MODELS = (QWEN2_5, QWEN3)


def _png(height: int, width: int, seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _body(model: str, **extra: Any) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": _png(h, w, i)}} for i, (h, w) in enumerate(((50, 70), (90, 40)))]
    return {"model": model, "temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": True,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare the pictures."}]}],
            **extra}


class Stack:
    """Engines in this process and gateway processes, per model; stopped together."""

    def __init__(self) -> None:
        self.engines: dict[tuple[str, Wire, Role], RunningEngine] = {}
        self.gateways: dict[tuple[str, str], Child] = {}

    def engine(self, model: str, wire: Wire, role: Role) -> RunningEngine:
        key = (model, wire, role)
        if key not in self.engines:
            self.engines[key] = start_engine(EngineConfig(model=bundle_dir(model), port=0, wire=wire, role=role))
        return self.engines[key]

    def single(self, model: str) -> Child:
        key = (model, "vllm")
        if key not in self.gateways:
            engine = self.engine(model, Wire.VLLM, Role.SINGLE)
            self.gateways[key] = start_gateway(str(bundle_dir(model)), [engine.port],
                                               extra=["--served-model-name", model])
        return self.gateways[key]

    def pd(self, model: str, wire: Wire, decode_ports: tuple[int, ...] = ()) -> Child:
        key = (model, f"pd-{wire}-{decode_ports}")
        if key not in self.gateways:
            prefill = self.engine(model, wire, Role.PREFILL)
            decode = self.engine(model, wire, Role.DECODE)
            # SGLang: the bootstrap port on the command line; TokenSpeed: the one the worker reports
            port_arg = [str(prefill.bootstrap_port)] if wire is Wire.SGLANG else []
            if wire is Wire.SGLANG:  # Qwen-VL images on SGLang need the opt-in (docs/engines-sglang.md, "M-RoPE positions")
                port_arg.append("--sglang-allow-mrope-media")
            decodes = [f"grpc://127.0.0.1:{p}" for p in (decode_ports or (decode.port,))]
            extra = ["--served-model-name", model, "--pd-disaggregation",
                     "--prefill", f"grpc://127.0.0.1:{prefill.port}", *port_arg]
            for url in decodes:
                extra += ["--decode", url]
            if decode_ports:
                extra += ["--worker-health-interval", "0.5"]
            child = start_gateway(str(bundle_dir(model)), [], extra=extra)
            if not decode_ports:
                wait_http_health(child, want_workers=2)
            self.gateways[key] = child
        return self.gateways[key]

    def epd(self, model: str, policy: str = "consistent_hashing") -> Child:
        key = (model, f"epd-{policy}")
        if key not in self.gateways:
            prefill = self.engine(model, Wire.TOKENSPEED, Role.PREFILL)
            decode = self.engine(model, Wire.TOKENSPEED, Role.DECODE)
            encode = self.engine(model, Wire.TOKENSPEED, Role.ENCODE)
            child = start_gateway(str(bundle_dir(model)), [], extra=[
                "--served-model-name", model, "--epd-disaggregation",
                "--prefill", f"grpc://127.0.0.1:{prefill.port}", "--decode", f"grpc://127.0.0.1:{decode.port}",
                "--encode", f"grpc://127.0.0.1:{encode.port}", str(encode.bootstrap_port),
                "--encode-policy", policy])
            wait_http_health(child, want_workers=3)
            self.gateways[key] = child
        return self.gateways[key]

    def stop(self) -> None:
        for child in self.gateways.values():
            child.stop()
        for engine in self.engines.values():
            engine.stop(grace=0)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack()
    yield s
    s.stop()


def _post(child: Child, body: dict[str, Any], timeout: float = 60.0) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{child.port}/v1/chat/completions", json=body, timeout=timeout)


def _tokens(resp: httpx.Response) -> tuple[str, list[Any]]:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    content = choice["logprobs"]["content"]
    return choice["message"]["content"], [(t["token"], t["bytes"]) for t in content]


def _segments(pid: int) -> set[str]:
    """The shared-memory segments process ``pid`` made (``mmgate-<pid>-*``; other runs' are not counted)."""
    return {p.name for p in Path("/dev/shm").glob(f"mmgate-{pid}-*")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("wire", (Wire.SGLANG, Wire.TOKENSPEED))
def test_a_pd_pair_answers_the_single_vllm_workers_tokens(stack: Stack, model: str, wire: Wire) -> None:
    want_text, want = _tokens(_post(stack.single(model), _body(model)))
    assert len(want) == 8
    resp = _post(stack.pd(model, wire), _body(model))
    text, got = _tokens(resp)
    assert (text, got) == (want_text, want)
    assert 0 <= int(resp.headers["X-Mmgate-Pd-Room"]) <= ROOM_MAX
    assert stack.engine(model, wire, Role.PREFILL).core.handoff.store.rooms() == 0  # claimed by the decode


@pytest.mark.parametrize("model", MODELS)
def test_epd_answers_the_single_vllm_workers_tokens(stack: Stack, model: str) -> None:
    want = _tokens(_post(stack.single(model), _body(model)))
    assert _tokens(_post(stack.epd(model), _body(model))) == want
    assert stack.engine(model, Wire.TOKENSPEED, Role.PREFILL).core.handoff.store.rooms() == 0


def test_epd_skips_the_encode_leg_for_text_only_requests(stack: Stack) -> None:
    body = {"model": QWEN3, "temperature": 0, "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Say hello."}]}
    single = _post(stack.single(QWEN3), body)
    epd = _post(stack.epd(QWEN3, "round_robin"), body)
    assert epd.status_code == 200, epd.text
    assert epd.json()["choices"][0]["message"] == single.json()["choices"][0]["message"]


def test_an_encode_worker_gone_after_selection_gives_a_503_and_leaks_nothing(stack: Stack) -> None:
    prefill = stack.engine(QWEN3, Wire.TOKENSPEED, Role.PREFILL)
    decode = stack.engine(QWEN3, Wire.TOKENSPEED, Role.DECODE)
    encode = start_engine(EngineConfig(model=bundle_dir(QWEN3), port=0, wire=Wire.TOKENSPEED, role=Role.ENCODE))
    gateway = start_gateway(str(bundle_dir(QWEN3)), [], extra=[
        "--served-model-name", QWEN3, "--epd-disaggregation", "--prefill", f"grpc://127.0.0.1:{prefill.port}",
        "--decode", f"grpc://127.0.0.1:{decode.port}", "--encode", f"grpc://127.0.0.1:{encode.port}",
        str(encode.bootstrap_port), "--worker-health-interval", "60", "--multimodal-tensor-transport", "shm"])
    try:
        wait_http_health(gateway, want_workers=3)
        before = _segments(gateway.proc.pid)
        encode.stop(grace=0)
        started = time.monotonic()
        resp = _post(gateway, _body(QWEN3), timeout=60)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "engine_unavailable"
        assert time.monotonic() - started < 30
        assert _segments(gateway.proc.pid) <= before
        # nothing of the failed request is left on the pair (the prefill frees its room when the cancellation
        # reaches it, which a loaded machine may delay by a moment)
        deadline = time.monotonic() + 10
        while prefill.core.handoff.store.rooms() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert prefill.core.handoff.store.rooms() == 0
    finally:
        gateway.stop()


def test_consistent_hashing_sends_the_same_item_to_the_same_encoder() -> None:
    workers = [Worker(url=f"grpc://e{i}:1", target=f"e{i}:1", assigned_role=Role.ENCODE) for i in range(4)]
    picks = {h: pick_encoder(workers, h, "consistent_hashing").url for h in ("a", "b", "c", "d", "e", "f")}
    assert picks == {h: pick_encoder(list(reversed(workers)), h, "consistent_hashing").url for h in picks}
    assert len(set(picks.values())) > 1
    rr = [pick_encoder(workers, "a", "round_robin").url for _ in range(4)]
    assert len(set(rr)) == 4


def test_a_text_only_request_is_served_by_the_pair(stack: Stack) -> None:
    body = {"model": QWEN2_5, "temperature": 0, "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Say hello."}]}
    single = _post(stack.single(QWEN2_5), body)
    pd = _post(stack.pd(QWEN2_5, Wire.SGLANG), body)
    assert pd.status_code == 200, pd.text
    assert pd.json()["choices"][0]["message"] == single.json()["choices"][0]["message"]


@pytest.mark.parametrize("wire", (Wire.SGLANG, Wire.TOKENSPEED))
def test_a_decode_leg_down_is_a_retryable_503_and_nothing_leaks(stack: Stack, wire: Wire) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    gateway = stack.pd(QWEN2_5, wire, decode_ports=(dead,))
    # The decode worker is never healthy: selection refuses (503) before any fetch.
    before = _segments(gateway.proc.pid)
    resp = _post(gateway, _body(QWEN2_5), timeout=30)
    assert resp.status_code == 503, resp.text
    assert resp.headers.get("X-SMG-Error-Code") in {"no_healthy_worker", "engine_unavailable"}
    assert _segments(gateway.proc.pid) <= before


def test_a_decode_engine_that_dies_after_selection_gives_a_503_not_a_hang(stack: Stack) -> None:
    """The decode worker was healthy when picked and is gone when the leg is sent: the decode leg fails with
    UNAVAILABLE, the prefill leg is cancelled, the answer is a retryable 503 within the timeout."""
    prefill = stack.engine(QWEN2_5, Wire.TOKENSPEED, Role.PREFILL)
    decode = start_engine(EngineConfig(model=bundle_dir(QWEN2_5), port=0, wire=Wire.TOKENSPEED, role=Role.DECODE))
    gateway = start_gateway(str(bundle_dir(QWEN2_5)), [], extra=[
        "--served-model-name", QWEN2_5, "--pd-disaggregation", "--prefill", f"grpc://127.0.0.1:{prefill.port}",
        "--decode", f"grpc://127.0.0.1:{decode.port}", "--worker-health-interval", "60",
        "--multimodal-tensor-transport", "shm"])
    try:
        wait_http_health(gateway, want_workers=2)
        before = _segments(gateway.proc.pid)
        decode.stop(grace=0)
        resp = _post(gateway, _body(QWEN2_5), timeout=60)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] in {"engine_unavailable", "no_healthy_worker"}
        assert _segments(gateway.proc.pid) <= before
    finally:
        gateway.stop()


# ---- settings and refusals -----------------------------------------------------------------------------

def test_the_command_line_names_prefill_bootstrap_ports_and_decode_workers() -> None:
    s = parse_settings(["--model", "m", "--pd-disaggregation", "--prefill", "grpc://a:1", "8998",
                        "--prefill", "grpc://b:2", "--decode", "grpc://c:3"], {})
    assert s.prefill_workers == (("grpc://a:1", 8998), ("grpc://b:2", None))
    assert s.decode_workers == ("grpc://c:3",)
    registry = WorkerRegistry.from_settings(s)
    assert [(w.target, w.role, w.bootstrap_port) for w in registry.workers] == [
        ("a:1", "prefill", 8998), ("b:2", "prefill", None), ("c:3", "decode", None)]
    for bad in (["--prefill", "grpc://a:1"], ["--pd-disaggregation", "--prefill", "grpc://a:1"],
                ["--pd-disaggregation", "--prefill", "grpc://a:1", "x", "--decode", "grpc://c:3"]):
        with pytest.raises(SystemExit):
            parse_settings(["--model", "m", *bad], {})


def test_rooms_fit_both_wires() -> None:
    rooms = {mint_room() for _ in range(200)}
    assert all(0 <= r <= ROOM_MAX for r in rooms) and len(rooms) > 190


def _state(mrope: bool, lm_only: bool, processing: MmProcessing = MmProcessing.ROUTER) -> Any:
    decode = Worker(url="grpc://d:1", target="d:1", assigned_role=Role.DECODE)
    decode.caps = Capabilities(wire=Wire.SGLANG, role=Role.DECODE, language_model_only=lm_only)
    # M-RoPE is asked of the family (Family.mrope), never read off the config
    return SimpleNamespace(workers=SimpleNamespace(workers=[decode]),
                           runtime=SimpleNamespace(family=SimpleNamespace(mrope=mrope, vllm_video_ids=False)),
                           settings=SimpleNamespace(mm_processing=processing, sglang_allow_mrope_media=False))


def _req(n: int = 1, media: bool = True) -> Any:
    content: Any = [{"type": "image_url", "image_url": {"url": _png(8, 8, 0)}}, {"type": "text", "text": "hi"}]
    return parse_chat_request(json.dumps({"model": "m", "n": n, "temperature": 1.0,
                                          "messages": [{"role": "user",
                                                        "content": content if media else "hi"}]}).encode())


@pytest.mark.parametrize(("state", "req", "code"), [
    ((True, True), (1, True), ErrorCode.PD_DECODE_LANGUAGE_MODEL_ONLY_MROPE),
    ((False, True), (2, False), ErrorCode.PD_DECODE_LANGUAGE_MODEL_ONLY_N_SAMPLES),
    ((False, True, MmProcessing.WORKER), (1, True), ErrorCode.PD_DECODE_LANGUAGE_MODEL_ONLY_MEDIA_REFS),
])
def test_a_language_model_only_decode_worker_refuses_what_it_cannot_serve(state: tuple[Any, ...],
                                                                          req: tuple[int, bool],
                                                                          code: ErrorCode) -> None:
    with pytest.raises(GatewayError) as refused:
        check_pd_request(_state(*state), _req(*req))
    assert refused.value.code is code
    assert refused.value.status == 400 and not refused.value.spec.retryable


def test_a_full_decode_worker_refuses_nothing() -> None:
    check_pd_request(_state(True, False), _req(2, True))


def test_an_encode_call_counts_on_its_encode_worker_while_it_runs() -> None:
    """Encode-worker load: each ``Encode`` RPC is in the worker's ``in_flight`` (``GET /workers``) while it runs,
    and released when it answers or fails (the failure wrapped as the encode worker's)."""
    async def scenario() -> tuple[list[int], int, int, bool]:
        gate = asyncio.Event()
        seen: list[int] = []

        class Client:
            fail = False

            async def unary(self, method: str, parse: Any, request: EncodedRequest) -> None:
                seen.append(worker.in_flight)
                await gate.wait()
                if Client.fail:
                    raise GatewayError(ErrorCode.ENGINE_UNAVAILABLE, "gone")

        worker = Worker(url="grpc://127.0.0.1:1", target="127.0.0.1:1", client=Client(),  # type: ignore[arg-type]
                        wire=Wire.TOKENSPEED.value, assigned_role=Role.ENCODE)
        calls = [asyncio.create_task(_encode_call(worker, EncodedRequest(b""))) for _ in range(2)]
        await asyncio.sleep(0.01)
        during = worker.in_flight
        gate.set()
        await asyncio.gather(*calls)
        after = worker.in_flight
        Client.fail, gate = True, asyncio.Event()
        gate.set()
        try:
            await _encode_call(worker, EncodedRequest(b""))
            failed = False
        except _EncodeFailed:
            failed = True
        return seen, during, after + worker.in_flight, failed

    seen, during, after, failed = asyncio.run(scenario())
    assert seen == [1, 2, 1] and during == 2 and after == 0 and failed
