"""The worker admin API end to end (issue 25, item 5): ``POST /workers``, ``GET``/``DELETE /workers/{id}``.

A reference engine (Qwen2.5-VL) on loopback; a gateway with no worker and no ``--model`` (its models come
from its workers; the search path holds this bundle under the name the engine reports).

* Add: before any worker a request for the model is 404 ``model_not_found``; ``POST /workers`` answers 201
  with the worker's id once it is probed and its model loaded, so the next request is answered at once.
* Remove while busy: a worker reached through a proxy that is frozen holds a streaming request in flight;
  ``DELETE`` answers 202 ``draining``; a new request goes to the other worker (the frozen one would never
  answer it); once the proxy thaws the stream completes normally, and then the removed worker is gone
  (``GET /workers/{id}`` 404 ``worker_not_found``) and listed nowhere.
* Bad input: 400 ``invalid_request`` for a body or field that is wrong, 409 ``worker_exists`` for a URL
  registered already, 404 for an id no worker has.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from mmgate.config.settings import parse_settings
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from tests.conftest import bundle_dir, model_roots
from tests.e2e.fault_proxy import FaultProxy
from tests.support.servers import gateway_in_thread

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
#: the admin API answers only with ``--admin-api-key`` (docs/security.md); GET /workers stays open
ADMIN_KEY = "sk-admin-test"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningEngine]:
    running = start_engine(EngineConfig(model=bundle_dir(MODEL), port=0, served_model_name=MODEL))
    yield running
    running.stop(grace=0)


@pytest.fixture()
def gateway() -> Iterator[str]:
    settings = parse_settings(["--model-path", str(model_roots()[0]), "--admin-api-key", ADMIN_KEY], {})
    with gateway_in_thread(settings) as base:
        yield base


def _wait_for(check: Any, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``check()`` until true (a sync point on the gateway's state, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _worker(base: str, worker_id: str) -> httpx.Response:
    return httpx.get(f"{base}/workers/{worker_id}", headers=ADMIN, timeout=10)


def test_a_worker_added_takes_traffic_once_probed_and_loaded(gateway: str, engine: RunningEngine) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    added = httpx.post(gateway + "/workers", json={"url": f"grpc://{engine.address}"}, headers=ADMIN, timeout=60)
    assert added.status_code == 201, added.text
    body = added.json()
    assert body["status"] == "ready" and body["url"] == f"grpc://{engine.address}"
    assert added.headers["Location"] == body["location"] == f"/workers/{body['worker_id']}"
    info = _worker(gateway, body["worker_id"]).json()
    assert (info["id"], info["model_id"], info["status"], info["healthy"], info["role"]) == (
        body["worker_id"], MODEL, "ready", True, "single")
    assert info["labels"]["model_type"] == "qwen2_5_vl"
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_a_worker_removed_while_streaming_drains_then_leaves(gateway: str, engine: RunningEngine) -> None:
    proxy = FaultProxy(engine.port, "drained")
    try:
        busy = httpx.post(gateway + "/workers", json={"url": f"grpc://127.0.0.1:{proxy.port}"}, headers=ADMIN,
                          timeout=60).json()
        assert busy["status"] == "ready"
        proxy.freeze()
        client = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=120)
        chunks: list[Any] = []
        failure: list[BaseException] = []

        def stream() -> None:
            try:
                for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                                            max_tokens=8, stream=True, extra_body={"ignore_eos": True}):
                    chunks.append(chunk)
            except BaseException as exc:  # reported by the main thread
                failure.append(exc)

        streaming = threading.Thread(target=stream)
        streaming.start()
        _wait_for(lambda: _worker(gateway, busy["worker_id"]).json()["in_flight"] == 1, "the stream to be in flight")
        other = httpx.post(gateway + "/workers", json={"url": f"grpc://{engine.address}"}, headers=ADMIN,
                           timeout=60).json()
        removed = httpx.delete(f"{gateway}/workers/{busy['worker_id']}", headers=ADMIN, timeout=10)
        assert removed.status_code == 202
        assert removed.json() == {"status": "draining", "worker_id": busy["worker_id"], "in_flight": 1}
        assert _worker(gateway, busy["worker_id"]).json()["status"] == "draining"
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
        assert out.usage is not None and out.usage.completion_tokens == 2  # the frozen worker would never answer
        assert _worker(gateway, busy["worker_id"]).json()["in_flight"] == 1
        proxy.thaw()
        streaming.join(timeout=120)
        assert not streaming.is_alive() and not failure
        assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason is not None
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        _wait_for(lambda: _worker(gateway, busy["worker_id"]).status_code == 404, "the drained worker to leave")
        gone = _worker(gateway, busy["worker_id"])
        assert gone.headers["X-SMG-Error-Code"] == "worker_not_found"
        listed = httpx.get(gateway + "/workers", timeout=10).json()
        assert [w["id"] for w in listed["workers"]] == [other["worker_id"]] and listed["total"] == 1
    finally:
        proxy.close()


@pytest.mark.parametrize("body, param", [
    (b"not json", None),
    (b"[1]", None),
    (b"{}", "url"),
    (b'{"url": 5}', "url"),
    (b'{"url": "http://127.0.0.1:1"}', "url"),
    (b'{"url": "grpc://127.0.0.1"}', "url"),
    (b'{"url": "grpc://127.0.0.1:1", "role": "leader"}', "role"),
    (b'{"url": "grpc://127.0.0.1:1", "role": "prefill"}', "role"),  # no --pd-disaggregation
    (b'{"url": "grpc://127.0.0.1:1", "bootstrap_port": "x"}', "bootstrap_port"),
    (b'{"url": "grpc://127.0.0.1:1", "bootstrap_port": 70000}', "bootstrap_port"),
])
def test_a_bad_add_is_400_invalid_request(gateway: str, body: bytes, param: str | None) -> None:
    resp = httpx.post(gateway + "/workers", content=body, headers={"Content-Type": "application/json", **ADMIN},
                      timeout=10)
    assert resp.status_code == 400 and resp.headers["X-SMG-Error-Code"] == "invalid_request", resp.text
    assert resp.json()["error"]["param"] == param
    assert httpx.get(gateway + "/workers", timeout=10).json()["workers"] == []


def test_ids_and_urls_are_checked(gateway: str, engine: RunningEngine) -> None:
    url = f"grpc://{engine.address}"
    first = httpx.post(gateway + "/workers", json={"url": url}, headers=ADMIN, timeout=60)
    again = httpx.post(gateway + "/workers", json={"url": url}, headers=ADMIN, timeout=60)
    assert first.status_code == 201 and (again.status_code, again.headers["X-SMG-Error-Code"]) == (409, "worker_exists")
    for method in ("GET", "DELETE"):
        bad = httpx.request(method, gateway + "/workers/not-a-uuid", headers=ADMIN, timeout=10)
        assert (bad.status_code, bad.headers["X-SMG-Error-Code"]) == (400, "invalid_request")
        unknown = httpx.request(method, f"{gateway}/workers/{uuid.uuid4()}", headers=ADMIN, timeout=10)
        assert (unknown.status_code, unknown.headers["X-SMG-Error-Code"]) == (404, "worker_not_found")
    removed = httpx.delete(f"{gateway}/workers/{first.json()['worker_id']}", headers=ADMIN, timeout=10)
    assert removed.status_code == 202 and removed.json()["status"] == "removed"
    assert httpx.get(gateway + "/workers", timeout=10).json()["workers"] == []
