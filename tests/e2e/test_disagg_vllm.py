"""Prefill/decode disaggregation over the vLLM wire, ``n > 1`` on every wire's pairs, and a
language-model-only decode worker, end to end: gateway process (``mmgate serve --pd-disaggregation``) ->
reference engines in this process (docs/disaggregation.md, docs/refengine-roles.md).

* vLLM wire, greedy, EOS ignored: a PD pair answers the same completion tokens (token bytes from
  ``logprobs``, and the text) as the single vLLM-wire worker, for Qwen2.5-VL and Qwen3-VL image requests;
  the engines' ``--record-dir`` recordings show that only the prefill leg received ``pixel_values``
  (the decode leg: the prompt and the grids); the prefill's KV was claimed by the decode.
* Faults: the decode leg down -> retryable 503, no ``/dev/shm/mmgate-<gatewaypid>-*`` segment left.
* ``n > 1``: SGLang and TokenSpeed pairs pass it to both legs (the prefill samples every choice's first
  token): the single worker's choices; a vLLM pair relays no KV for it (one consumer), so a text-only
  request is computed by the decode worker (the single worker's choices) and one with media is refused
  400 ``invalid_request`` (param ``n``) before anything is fetched.
* A language-model-only decode worker (``--language-model-only``, detected from each wire's labels):
  Qwen (M-RoPE) image requests refused 400 ``pd_decode_language_model_only_mrope``, ``n > 1``
  ``..._n_samples``, worker-mode media references ``..._media_refs``, each before the loopback origin
  sees a request; a text-only request, and a LLaVA-1.5 (no M-RoPE) image request on every wire, answer
  the single worker's tokens; the vLLM decode leg carried no tensor at all (hashes and placeholders).
"""

from __future__ import annotations

import base64
import io
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.engines.base import Role, Wire
from mmgate.cli.launch import Child, start_gateway, wait_http_health
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from tests.conftest import bundle_dir
from tests.e2e.test_disaggregation import (
    MODELS,
    QWEN2_5,
    QWEN3,
    _body,
    _post,
    _segments,
    _tokens,
)
from tests.support.servers import MediaOrigin, media_origin

LLAVA = "llava-hf/llava-1.5-7b-hf"
TEXT = {"temperature": 0, "max_tokens": 4, "ignore_eos": True, "messages": [{"role": "user", "content": "Say hello."}]}


def _png_bytes(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _image_body(model: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What is this?"}]}], **extra}


def _data_url(height: int, width: int, seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(_png_bytes(height, width, seed)).decode()


def _dead_port() -> int:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    """Engines (in this process) per (model, wire, role, options) and gateway processes; stopped together."""

    def __init__(self, records: Path) -> None:
        self.records = records
        self.engines: dict[tuple[Any, ...], RunningEngine] = {}
        self.gateways: dict[tuple[Any, ...], Child] = {}

    def engine(self, model: str, wire: Wire, role: Role = Role.SINGLE, **options: Any) -> RunningEngine:
        key = (model, wire, role, tuple(sorted(options.items())))
        if key not in self.engines:
            self.engines[key] = start_engine(EngineConfig(model=bundle_dir(model), port=0, wire=wire, role=role,
                                                          **options))
        return self.engines[key]

    def record_dir(self, model: str, wire: Wire, role: Role) -> Path:
        return self.records / f"{model.replace('/', '--')}-{wire}-{role}"

    def single(self, model: str, wire: Wire = Wire.VLLM) -> Child:
        key = (model, "single", wire)
        if key not in self.gateways:
            engine = self.engine(model, wire)
            # Qwen-VL images on SGLang need the opt-in (docs/engines-sglang.md, "M-RoPE positions")
            opt_in = ["--sglang-allow-mrope-media"] if wire is Wire.SGLANG else []
            self.gateways[key] = start_gateway(str(bundle_dir(model)), [engine.port],
                                               extra=["--served-model-name", model, *opt_in])
        return self.gateways[key]

    def pd(self, model: str, wire: Wire, *, lm_only: bool = False, record: bool = False,
           extra: tuple[str, ...] = ()) -> Child:
        key = (model, "pd", wire, lm_only, record, extra)
        if key not in self.gateways:
            options: dict[str, Any] = {}
            if record:
                options = {"record_dir": self.record_dir(model, wire, Role.PREFILL)}
            prefill = self.engine(model, wire, Role.PREFILL, **options)
            decode_options: dict[str, Any] = {"language_model_only": True} if lm_only else {}
            if record:
                decode_options["record_dir"] = self.record_dir(model, wire, Role.DECODE)
            decode = self.engine(model, wire, Role.DECODE, **decode_options)
            port_arg = [str(prefill.bootstrap_port)] if wire is Wire.SGLANG else []
            if wire is Wire.SGLANG:  # Qwen-VL images on SGLang need the opt-in (docs/engines-sglang.md, "M-RoPE positions")
                port_arg.append("--sglang-allow-mrope-media")
            child = start_gateway(str(bundle_dir(model)), [], extra=[
                "--served-model-name", model, "--pd-disaggregation", "--mm-allow-private-media-hosts",
                "--prefill", f"grpc://127.0.0.1:{prefill.port}", *port_arg,
                "--decode", f"grpc://127.0.0.1:{decode.port}", *extra])
            wait_http_health(child, want_workers=2)
            self.gateways[key] = child
        return self.gateways[key]

    def stop(self) -> None:
        for child in self.gateways.values():
            child.stop()
        for engine in self.engines.values():
            engine.stop(grace=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("records"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def origin() -> Iterator[MediaOrigin]:
    with media_origin() as o:
        yield o


def _recorded(folder: Path, request_id: str) -> dict[str, np.ndarray]:
    (path,) = [p for p in folder.glob("*.npz") if p.stem == request_id]
    with np.load(path) as npz:
        return {k: npz[k] for k in npz.files}


def _shm_tensors_sent(child: Child) -> float:
    """``smg_mm_tensors_total{runtime="vllm",path="shm"}`` of a gateway."""
    text = httpx.get(f"http://127.0.0.1:{child.port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("smg_mm_tensors_total{") and 'path="shm"' in line and 'runtime="vllm"' in line)


def _choices(resp: httpx.Response) -> list[list[Any]]:
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    return [[(t["token"], t["bytes"]) for t in c["logprobs"]["content"]] for c in choices]


def _refused(resp: httpx.Response, code: str, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert error["code"] == code, error
    return error


# ---- vLLM-wire PD: the single worker's tokens, pixels only on the prefill leg ----------------------------

@pytest.mark.parametrize("model", MODELS)
def test_a_vllm_pd_pair_answers_the_single_vllm_workers_tokens(stack: Stack, model: str) -> None:
    want_text, want = _tokens(_post(stack.single(model), _body(model)))
    assert len(want) == 8
    resp = _post(stack.pd(model, Wire.VLLM, record=True), _body(model))
    assert _tokens(resp) == (want_text, want)
    prefill_engine = stack.engine(model, Wire.VLLM, Role.PREFILL,
                                  record_dir=stack.record_dir(model, Wire.VLLM, Role.PREFILL))
    assert prefill_engine.core.handoff.store.rooms() == 0  # the decode claimed the KV
    # the engines' own records (--record-dir): what each leg was sent, under the request's id
    request_id = resp.headers["X-Request-Id"]
    prefill = _recorded(stack.record_dir(model, Wire.VLLM, Role.PREFILL), request_id)
    decode = _recorded(stack.record_dir(model, Wire.VLLM, Role.DECODE), request_id)
    assert "pixel_values" in prefill and prefill["pixel_values"].size > 0
    assert "pixel_values" not in decode
    np.testing.assert_array_equal(decode["image_grid_thw"], prefill["image_grid_thw"])  # identity: the grids
    np.testing.assert_array_equal(decode["input_ids"], prefill["input_ids"])  # the prefill-expanded prompt


def test_a_streamed_vllm_pd_answer_streams_the_single_workers_text(stack: Stack) -> None:
    body = {**_body(QWEN2_5), "stream": True}
    body.pop("logprobs")

    def text(child: Child) -> str:
        with httpx.stream("POST", f"http://127.0.0.1:{child.port}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")]
        return "".join(json.loads(line)["choices"][0]["delta"].get("content") or "" for line in lines
                       if json.loads(line)["choices"])

    want = text(stack.single(QWEN2_5))
    assert want and text(stack.pd(QWEN2_5, Wire.VLLM, record=True)) == want


def test_a_vllm_decode_leg_down_is_a_retryable_503_and_nothing_leaks(stack: Stack) -> None:
    prefill = stack.engine(QWEN3, Wire.VLLM, Role.PREFILL, handoff_timeout_s=1.0)
    # never healthy: selection refuses before any fetch
    never = start_gateway(str(bundle_dir(QWEN3)), [], extra=[
        "--served-model-name", QWEN3, "--pd-disaggregation", "--prefill", f"grpc://127.0.0.1:{prefill.port}",
        "--decode", f"grpc://127.0.0.1:{_dead_port()}", "--worker-health-interval", "0.5"])
    try:
        resp = _post(never, _body(QWEN3), timeout=30)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "no_healthy_worker" and resp.headers.get("Retry-After") == "1"
    finally:
        never.stop()
    # healthy when picked, gone when its leg is sent: the prefill leg ran (through shared memory)
    decode = start_engine(EngineConfig(model=bundle_dir(QWEN3), port=0, wire=Wire.VLLM, role=Role.DECODE))
    gateway = start_gateway(str(bundle_dir(QWEN3)), [], extra=[
        "--served-model-name", QWEN3, "--pd-disaggregation", "--prefill", f"grpc://127.0.0.1:{prefill.port}",
        "--decode", f"grpc://127.0.0.1:{decode.port}", "--worker-health-interval", "60",
        "--multimodal-tensor-transport", "shm"])
    try:
        wait_http_health(gateway, want_workers=2)
        decode.stop(grace=0)
        expired = prefill.core.handoff.store.expired
        started = time.monotonic()
        resp = _post(gateway, _body(QWEN3), timeout=60)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "engine_unavailable"
        assert resp.headers.get("Retry-After") == "1"  # retryable
        assert time.monotonic() - started < 30
        assert _shm_tensors_sent(gateway) > 0  # the prefill leg's pixels went through shared memory...
        assert _segments(gateway.proc.pid) == set()  # ...and no segment is left
        # the prefill leg ran; the KV nobody claimed is freed by the prefill engine's --handoff-timeout
        deadline = time.monotonic() + 10
        while prefill.core.handoff.store.rooms() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert prefill.core.handoff.store.rooms() == 0 and prefill.core.handoff.store.expired == expired + 1
    finally:
        gateway.stop()


# ---- n > 1 through the gateway --------------------------------------------------------------------------

def test_n_samples_on_sglang_and_tokenspeed_pairs_are_the_single_workers_choices(stack: Stack) -> None:
    greedy = _body(QWEN2_5, n=2)
    want = _choices(_post(stack.single(QWEN2_5), greedy))
    assert len(want) == 2 and want[0] == want[1]
    assert _choices(_post(stack.pd(QWEN2_5, Wire.SGLANG), greedy)) == want  # SGLang's wire has no seed
    seeded = _body(QWEN2_5, n=2, temperature=1.5, seed=11)
    want = _choices(_post(stack.single(QWEN2_5), seeded))
    assert want[0] != want[1]  # two draws
    assert _choices(_post(stack.pd(QWEN2_5, Wire.TOKENSPEED), seeded)) == want


def test_n_samples_on_a_vllm_pair(stack: Stack, origin: MediaOrigin) -> None:
    seeded = {"model": QWEN2_5, **TEXT, "n": 2, "temperature": 1.5, "seed": 5, "logprobs": True}
    want = _choices(_post(stack.single(QWEN2_5), seeded))
    assert want[0] != want[1]
    resp = _post(stack.pd(QWEN2_5, Wire.VLLM, record=True), seeded)
    assert _choices(resp) == want
    # no KV handoff for n > 1: the decode worker computed the prompt; no prefill leg was sent
    prefill_records = stack.record_dir(QWEN2_5, Wire.VLLM, Role.PREFILL)
    assert not (prefill_records / f"{resp.headers['X-Request-Id']}.npz").exists()
    assert (stack.record_dir(QWEN2_5, Wire.VLLM, Role.DECODE) / f"{resp.headers['X-Request-Id']}.npz").exists()
    # with media: refused before the fetch (the decode leg never carries the pixels it would need)
    url = origin.add("/n2.png", _png_bytes(40, 60, 3), "image/png")
    error = _refused(_post(stack.pd(QWEN2_5, Wire.VLLM, record=True), _image_body(QWEN2_5, url, n=2)),
                     "invalid_request")
    assert error["param"] == "n"
    assert origin.settled()["/n2.png"] == 0


# ---- a language-model-only decode worker ----------------------------------------------------------------

def test_the_probe_reads_each_wires_language_model_only_label(stack: Stack) -> None:
    import asyncio

    from mmgate.engines.client import WorkerClient

    async def caps(engine: RunningEngine) -> Any:
        client = WorkerClient(engine.address)
        try:
            return (await client.probe(timeout_s=10)).capabilities
        finally:
            await client.close()

    for wire in (Wire.VLLM, Wire.SGLANG, Wire.TOKENSPEED):
        found = asyncio.run(caps(stack.engine(LLAVA, wire, Role.DECODE, language_model_only=True)))
        assert found is not None and found.role is Role.DECODE and found.language_model_only, (wire, found)
        full = asyncio.run(caps(stack.engine(LLAVA, wire, Role.PREFILL)))
        assert not full.language_model_only


def test_a_language_model_only_decode_refuses_what_it_cannot_serve_before_any_fetch(
        stack: Stack, origin: MediaOrigin) -> None:
    gateway = stack.pd(QWEN3, Wire.VLLM, lm_only=True)
    url = origin.add("/lm-only.png", _png_bytes(40, 60, 1), "image/png")
    _refused(_post(gateway, _image_body(QWEN3, url)), "pd_decode_language_model_only_mrope")
    _refused(_post(gateway, {"model": QWEN3, **TEXT, "n": 2}), "pd_decode_language_model_only_n_samples")
    assert origin.settled()["/lm-only.png"] == 0


def test_worker_side_media_references_are_refused_for_a_language_model_only_decode(
        stack: Stack, origin: MediaOrigin) -> None:
    gateway = stack.pd(LLAVA, Wire.VLLM, lm_only=True, extra=("--mm-processing", "worker"))
    url = origin.add("/refs.png", _png_bytes(40, 60, 2), "image/png")
    _refused(_post(gateway, _image_body(LLAVA, url)), "pd_decode_language_model_only_media_refs")
    assert origin.settled()["/refs.png"] == 0


def test_a_language_model_only_decode_serves_text_only_requests(stack: Stack) -> None:
    body = {"model": QWEN3, **TEXT, "logprobs": True}
    assert _tokens(_post(stack.pd(QWEN3, Wire.VLLM, lm_only=True), body)) == _tokens(_post(stack.single(QWEN3), body))


@pytest.mark.parametrize("wire", (Wire.VLLM, Wire.SGLANG, Wire.TOKENSPEED))
def test_a_language_model_only_decode_serves_a_llava_image_request(stack: Stack, wire: Wire) -> None:
    """LLaVA-1.5 positions media with plain 1-D RoPE: the decode worker needs only the prompt and the KV."""
    body = _image_body(LLAVA, _data_url(50, 70, 4))
    want = _tokens(_post(stack.single(LLAVA), body))
    assert len(want[1]) == 6
    resp = _post(stack.pd(LLAVA, wire, lm_only=True, record=True), body)
    assert _tokens(resp) == want
    if wire is Wire.VLLM:  # the decode leg: the expanded prompt and nothing else (hashes, placeholders)
        decode = _recorded(stack.record_dir(LLAVA, wire, Role.DECODE), resp.headers["X-Request-Id"])
        prefill = _recorded(stack.record_dir(LLAVA, wire, Role.PREFILL), resp.headers["X-Request-Id"])
        assert set(decode) == {"input_ids"} and "pixel_values" in prefill
        np.testing.assert_array_equal(decode["input_ids"], prefill["input_ids"])
