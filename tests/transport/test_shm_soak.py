"""No shared-memory segment outlives its request: 200 requests through gateway + reference engine
processes over shm, including client disconnects (mid-stream and mid-request) and engine errors."""

from __future__ import annotations

import base64
import io
import os
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.cli.launch import Child, start_engine, start_gateway
from tests.conftest import bundle_dir
from tests.support.shm_scope import own_segments

MODEL = "Qwen/Qwen2-VL-2B-Instruct"


def segments() -> set[str]:
    return own_segments()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, Child]]:
    logs = tmp_path_factory.mktemp("soak-logs")
    bundle = str(bundle_dir(MODEL))
    engine = start_engine(bundle, log_dir=logs)
    try:
        gateway = start_gateway(bundle, [engine.port], log_dir=logs, extra=[
            "--served-model-name", MODEL, "--multimodal-tensor-transport", "shm", "--multimodal-shm-min-bytes", "0"])
        try:
            yield engine, gateway
        finally:
            gateway.stop()
    finally:
        engine.stop()


def _image(i: int) -> str:
    arr = np.random.default_rng(i).integers(0, 256, (40 + i % 7 * 9, 50 + i % 5 * 11, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _one(base: str, i: int) -> str:
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _image(i)}}, {"type": "text", "text": f"request {i}"}]}]}
    kind = i % 5
    url = base + "/v1/chat/completions"
    try:
        if kind == 0:  # the engine refuses (a logit_bias token id outside the model's vocabulary)
            r = httpx.post(url, json={**body, "logit_bias": {"99999999": 1.0}}, timeout=60)
            return f"engine_error:{r.status_code}:{r.headers.get('X-SMG-Error-Code')}"
        if kind == 1:  # stream, client goes away after the first event
            with httpx.stream("POST", url, json={**body, "stream": True, "max_tokens": 12, "ignore_eos": True},
                              timeout=60) as r:
                for _ in r.iter_lines():
                    break
            return "stream_disconnect"
        if kind == 2:  # the client gives up before the answer
            try:
                httpx.post(url, json={**body, "max_tokens": 12, "ignore_eos": True}, timeout=0.05)
            except httpx.TimeoutException:
                return "client_timeout"
            return "client_timeout_not_hit"
        r = httpx.post(url, json=body, timeout=60)
        return f"ok:{r.status_code}"
    except httpx.HTTPError as exc:
        return f"transport_error:{type(exc).__name__}"


def test_no_segment_left_after_200_requests_with_disconnects_and_engine_errors(stack: tuple[Child, Child]) -> None:
    _, gateway = stack
    base = f"http://127.0.0.1:{gateway.port}"
    before = segments()
    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = Counter(pool.map(lambda i: _one(base, i), range(200)))
    print("soak outcomes:", dict(outcomes))
    assert outcomes["ok:200"] == 80
    assert outcomes["engine_error:400:engine_rejected"] == 40
    assert outcomes["stream_disconnect"] == 40
    assert outcomes["client_timeout"] + outcomes["client_timeout_not_hit"] == 40
    deadline = time.monotonic() + 30
    while segments() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert segments() - before == set()
    metrics = httpx.get(base + "/metrics", timeout=10).text
    shm_line = next(ln for ln in metrics.splitlines() if ln.startswith('smg_mm_tensors_total{path="shm",runtime="vllm"}'))
    assert float(shm_line.split()[-1]) >= 3 * 160  # every request that reached assembly sent its 3 tensors by shm
    assert httpx.get(base + "/health", timeout=10).status_code == 200
