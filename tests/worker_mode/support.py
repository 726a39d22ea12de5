"""Helpers for the worker-side processing tests: Redis, sidecars, fake engines, gateways, media.

Everything listens on 127.0.0.1.  ``redis-server`` runs with a temporary
folder and no persistence; a missing binary fails the tests (CI installs it:
``apt-get install -y redis-server``).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import numpy as np
import redis
import uvicorn
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.api.app import create_app
from mmgate.gateway.state import GatewayState, build_state
from mmgate.cli.launch import free_port, gateway_answers
from mmgate.config.settings import Settings
from tests.support.settle import POLL_INTERVAL_S, CountingServer, ReadCounting, SettleCounts

MODEL = "Qwen/Qwen2-VL-2B-Instruct"


# ---- media -------------------------------------------------------------------------------


def image_bytes(h: int, w: int, seed: int, fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy) % 256], axis=-1)
    arr = np.clip(base + rng.integers(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(parts: Sequence[dict], *, stream: bool = False, max_tokens: int = 4, model: str = MODEL) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                  "messages": [{"role": "user", "content": list(parts)}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Origin(SettleCounts):
    """A loopback media origin: static bodies, ``/slow/...`` (sleeps ``slow_s``), ``/status/NNN``.

    ``settled()`` is the sync point before asserting that a path saw no hit.
    """

    port: int = 0
    files: dict[str, bytes] = field(default_factory=dict)
    hits: Counter[str] = field(default_factory=Counter)
    slow_s: float = 5.0

    def settled(self, timeout_s: float = 5.0) -> Counter[str]:
        """``hits`` once every connection made before this call has been accepted and its request read
        (the request line, not a ``/slow/`` body; see :mod:`tests.support.settle`)."""
        return self._settled(lambda: Counter(self.hits), f"media origin on port {self.port}", timeout_s)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def add(self, path: str, body: bytes) -> str:
        self.files[path] = body
        return self.url(path)


@contextmanager
def origin() -> Iterator[Origin]:
    state = Origin()

    class Handler(ReadCounting):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            state.hits[self.path] += 1
            self._mark_read()
            if self.path.startswith("/status/"):
                self.send_error(int(self.path.rsplit("/", 1)[1]))
                return
            if self.path.startswith("/slow/"):
                time.sleep(state.slow_s)
            body = state.files.get(self.path.replace("/slow/", "/", 1))
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:
                pass

        def log_message(self, *args: object) -> None:
            pass

    Handler.origin = state
    server = CountingServer(("127.0.0.1", 0), Handler)
    server.origin = state
    server.daemon_threads = True
    server.block_on_close = False  # type: ignore[attr-defined]
    state.port = int(server.server_address[1])
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": POLL_INTERVAL_S}, daemon=True).start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


# ---- bundles -----------------------------------------------------------------------------


def copy_bundle(src: Path, dst: Path, **config: object) -> Path:
    """A copy of bundle ``src`` at ``dst`` (never write into the shared models), with ``config.json`` keys replaced."""
    shutil.copytree(src, dst)
    if config:
        path = dst / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}, indent=1))
    return dst


def drop_added_token(bundle: Path, token: str) -> None:
    """Remove the added token ``token`` from a bundle's tokenizer files (``tokenizer.json`` ``added_tokens``,
    ``tokenizer_config.json`` ``added_tokens_decoder`` and ``additional_special_tokens``)."""
    path = bundle / "tokenizer.json"
    data = json.loads(path.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != token]
    path.write_text(json.dumps(data))
    path = bundle / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["added_tokens_decoder"] = {k: v for k, v in data.get("added_tokens_decoder", {}).items()
                                    if v["content"] != token}
    data["additional_special_tokens"] = [t for t in data.get("additional_special_tokens", []) if t != token]
    path.write_text(json.dumps(data))


# ---- processes ---------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self.alive():
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=timeout_s)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def spawn(name: str, args: Sequence[str], log_dir: Path) -> Proc:
    log = log_dir / f"{name}-{time.monotonic_ns()}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(args), stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return Proc(name, proc, log)


@dataclass
class RedisServer:
    proc: Proc
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)


def start_redis(folder: Path, *extra: str) -> RedisServer:
    """``redis-server`` on a free loopback port, no persistence, data folder ``folder``."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                           "--dir", str(folder), "--protected-mode", "no", *extra], folder)
    server = RedisServer(proc, port)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if server.client().ping():
                return server
        except redis.RedisError:
            time.sleep(0.05)
    proc.stop()
    raise RuntimeError(f"redis-server did not start:\n{proc.tail()}")


def sidecar_args(model: Path, redis_url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mmgate.cli", "sidecar", "--model", str(model), "--redis-url", redis_url, *extra]


def wait_for(predicate, timeout_s: float, what: str, step_s: float = 0.1) -> float:  # noqa: ANN001
    """Poll until ``predicate()`` is true; the seconds it took.  Raises AssertionError on timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(step_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def server_info(port: int) -> vllm_engine_pb2.GetServerInfoResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        return stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=5)


# ---- fake engines ------------------------------------------------------------------------


class FakeEngine(vllm_engine_pb2_grpc.VllmEngineServicer):
    """A model-free vLLM-wire worker with chosen labels; records every GenerateRequest.

    With ``media_refs`` it reports ``prompt_tokens`` = ids + ``EXPANSION`` per item
    (standing in for the expansion it would do), else the number of ids it got.
    """

    EXPANSION = 100

    def __init__(self, processor: str = "", schemes: str = "") -> None:
        self.processor = processor
        self.schemes = schemes
        self.healthy = True
        self.requests: list[vllm_engine_pb2.GenerateRequest] = []
        self.fail_with: tuple[grpc.StatusCode, str] | None = None
        self.port = 0
        self._server: grpc.Server | None = None

    def start(self) -> FakeEngine:
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def HealthCheck(self, request, context):  # noqa: ANN001, ANN201, N802
        return vllm_engine_pb2.HealthCheckResponse(healthy=self.healthy, message="fake")

    def GetModelInfo(self, request, context):  # noqa: ANN001, ANN201, N802
        return vllm_engine_pb2.GetModelInfoResponse(model_path=MODEL, served_model_name=MODEL, model_type="qwen2_vl",
                                                    supports_vision=True, max_context_length=32768,
                                                    eos_token_ids=[151645], is_generation=True)

    def GetServerInfo(self, request, context):  # noqa: ANN001, ANN201, N802
        return vllm_engine_pb2.GetServerInfoResponse(
            server_type="vllm-grpc", mm_processor=self.processor, mm_media_ref_schemes=self.schemes,
            mm_processor_source="flag" if self.processor else "", multimodal_encoder_dtype="float32")

    def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
        self.requests.append(request)
        if self.fail_with is not None:
            context.abort(*self.fail_with)
        ids = len(request.tokenized.input_ids) + self.EXPANSION * len(request.media_refs.items)
        complete = vllm_engine_pb2.GenerateComplete(output_ids=[9707, 0], finish_reason="stop",
                                                    prompt_tokens=ids, completion_tokens=2)
        if request.stream:
            for tok in (9707, 0):
                yield vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
                    token_ids=[tok], prompt_tokens=ids, completion_tokens=1))
        yield vllm_engine_pb2.GenerateResponse(complete=complete)


# ---- gateways ----------------------------------------------------------------------------


@dataclass
class Gateway:
    base: str
    state: GatewayState

    def post(self, body: dict, timeout_s: float = 120) -> httpx.Response:
        return httpx.post(self.base + "/v1/chat/completions", json=body, timeout=timeout_s)

    def labels(self) -> list[dict[str, str]]:
        return [w["labels"] for w in httpx.get(self.base + "/workers", timeout=10).json()["workers"]]

    def healthy(self) -> list[bool]:
        return [w["healthy"] for w in httpx.get(self.base + "/workers", timeout=10).json()["workers"]]

    def decisions(self) -> dict[tuple[str, str], float]:
        """``smg_mm_processing_total`` read from /metrics: (mode, reason) -> count, for this model."""
        text = httpx.get(self.base + "/metrics", timeout=10).text
        counts: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "smg_mm_processing_total" and sample.labels["model"] == MODEL:
                    counts[(sample.labels["mode"], sample.labels["reason"])] = sample.value
        return counts


@contextmanager
def gateway(settings: Settings, health_interval_s: float = 0.2) -> Iterator[Gateway]:
    """The real gateway app under uvicorn in a thread, with a fast worker health loop."""
    state = build_state(settings)
    state.workers.health_interval_s = health_interval_s
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(base), 60, "the gateway")
    try:
        yield Gateway(base, state)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _answers(base: str) -> bool:
    try:
        return gateway_answers(httpx.get(base + "/health", timeout=1))  # 503 while no worker is healthy
    except httpx.HTTPError:
        return False


def delta(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """Counters that moved, and by how much."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
