"""Issue 15, item 6 and the ``/health`` part of 10: a busy worker is not a dead one.

* The failure count (:meth:`mmgate.routing.workers.Worker.record_probe`), rule by rule.
* Probes that queue behind work: a real gRPC engine on loopback whose HealthCheck waits until its
  running Generate is done (as a server whose every thread is generating does); with probes every
  0.2 s and a 0.2 s deadline, the old registry marked it unhealthy on the first late probe and
  answered ``503 no_healthy_worker``; now the late probes are counted as busy and it stays healthy.
* Large images on the real reference engine (``mmgate engine`` + ``mmgate serve`` as child
  processes): ``/workers`` never shows the worker unhealthy, light requests never get
  ``no_healthy_worker``, and the attack ends with :func:`tests.abuse.support.after_attack`.
* Dead: the engine killed, ``/health`` answers 503 within a few probe intervals; restarted on its
  port, 200 again.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from PIL import Image
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.engines.base import Probe, ProbeOutcome
from mmgate.cli.launch import start_engine
from mmgate.routing.workers import HealthPolicy, Worker
from mmgate.config.settings import FetchSettings, Settings
from tests.abuse.support import (
    DEFAULT_MODEL,
    HealthWatch,
    after_attack,
    bundle_path,
    chat_body,
    light_request,
    running_stack,
    shm_segments,
)
from tests.support.servers import gateway_in_thread

POLICY = HealthPolicy(interval_s=1.0, timeout_s=0.5, unhealthy_after=3, busy_grace_s=60.0)
OK = Probe(ProbeOutcome.OK)


def probe(outcome: ProbeOutcome) -> Probe:
    return Probe(outcome)


def healthy_worker() -> Worker:
    worker = Worker(url="grpc://127.0.0.1:1", target="127.0.0.1:1")
    worker.record_probe(OK, POLICY, now=100.0, last_answer=100.0)
    assert worker.healthy
    return worker


# ---- the failure count ------------------------------------------------------------------------

def test_an_idle_worker_is_marked_unhealthy_only_on_the_third_consecutive_timeout() -> None:
    worker = healthy_worker()
    seen = [worker.record_probe(probe(ProbeOutcome.TIMEOUT), POLICY, now=101.0 + i, last_answer=100.0)
            for i in range(3)]
    assert seen == [True, True, False]
    assert worker.failures == 3 and worker.last_probe == "timeout"


def test_other_rpc_errors_count_like_timeouts() -> None:
    worker = healthy_worker()
    assert worker.record_probe(probe(ProbeOutcome.ERROR), POLICY, now=101.0, last_answer=100.0)
    assert worker.record_probe(probe(ProbeOutcome.ERROR), POLICY, now=102.0, last_answer=100.0)
    assert not worker.record_probe(probe(ProbeOutcome.ERROR), POLICY, now=103.0, last_answer=100.0)


def test_a_pass_between_failures_starts_the_count_again() -> None:
    worker = healthy_worker()
    for now in (101.0, 102.0):
        worker.record_probe(probe(ProbeOutcome.TIMEOUT), POLICY, now=now, last_answer=100.0)
    worker.record_probe(OK, POLICY, now=103.0, last_answer=103.0)
    assert worker.failures == 0
    for now in (104.0, 105.0):
        assert worker.record_probe(probe(ProbeOutcome.TIMEOUT), POLICY, now=now, last_answer=103.0)


def test_nothing_listening_marks_the_worker_unhealthy_at_once() -> None:
    worker = healthy_worker()
    worker.in_flight = 2  # requests in flight do not excuse a refused connection
    assert not worker.record_probe(probe(ProbeOutcome.UNREACHABLE), POLICY, now=101.0, last_answer=100.0)
    assert worker.failures == 1 and worker.last_probe == "unreachable"


def test_a_worker_that_says_it_is_not_healthy_is_unhealthy_at_once() -> None:
    worker = healthy_worker()
    assert not worker.record_probe(probe(ProbeOutcome.NOT_SERVING), POLICY, now=101.0, last_answer=101.0)


def test_timeouts_while_requests_are_in_flight_are_busy_not_failures() -> None:
    worker = healthy_worker()
    worker.in_flight = 3
    for i in range(10):  # ten late probes in a row: still healthy, nothing counted
        assert worker.record_probe(probe(ProbeOutcome.TIMEOUT), POLICY, now=101.0 + i, last_answer=100.0)
    assert worker.failures == 0 and worker.busy_probes == 10 and worker.last_probe == "busy"


def test_busy_is_excused_only_within_the_grace_since_the_last_answer() -> None:
    worker = healthy_worker()
    worker.in_flight = 1
    late = 100.0 + POLICY.busy_grace_s + 1.0  # no answer at all (no probe, no Generate message) for longer
    for i in range(2):
        assert worker.record_probe(probe(ProbeOutcome.TIMEOUT), POLICY, now=late + i, last_answer=100.0)
    assert not worker.record_probe(probe(ProbeOutcome.TIMEOUT), POLICY, now=late + 2, last_answer=100.0)
    assert worker.busy_probes == 0 and worker.failures == 3


def test_the_first_passing_probe_brings_an_unhealthy_worker_back() -> None:
    worker = healthy_worker()
    worker.record_probe(probe(ProbeOutcome.UNREACHABLE), POLICY, now=101.0, last_answer=100.0)
    assert not worker.healthy
    assert worker.record_probe(OK, POLICY, now=102.0, last_answer=102.0)
    assert worker.failures == 0 and worker.busy_probes == 0 and worker.last_probe == "ok"


def test_a_health_policy_refuses_nonsense() -> None:
    for bad in ({"interval_s": 0.0}, {"timeout_s": -1.0}, {"unhealthy_after": 0}):
        with pytest.raises(ValueError):
            HealthPolicy(**bad)  # type: ignore[arg-type]


# ---- probes that queue behind work (a real gRPC engine on loopback) --------------------------

class QueueingEngine(vllm_engine_pb2_grpc.VllmEngineServicer):
    """A vision worker whose HealthCheck waits while a Generate runs (``generate_s`` each, one at a time),
    as a health probe does on a server with every thread generating."""

    def __init__(self, generate_s: float) -> None:
        self.generate_s = generate_s
        self.model = threading.Lock()
        self.idle = threading.Condition()
        self.running = 0

    def HealthCheck(self, request, context):  # noqa: N802 - gRPC API
        with self.idle:
            self.idle.wait_for(lambda: self.running == 0, timeout=30)
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="ok")

    def GetModelInfo(self, request, context):  # noqa: N802
        return vllm_engine_pb2.GetModelInfoResponse(model_path="queueing", served_model_name="queueing",
                                                    is_generation=True, max_context_length=32768,
                                                    vocab_size=151936, supports_vision=True,
                                                    model_type="qwen2_vl", eos_token_ids=[151645])

    def GetServerInfo(self, request, context):  # noqa: N802
        return vllm_engine_pb2.GetServerInfoResponse(server_type="vllm-grpc")

    def Generate(self, request, context):  # noqa: N802
        with self.idle:
            self.running += 1
        try:
            with self.model:
                time.sleep(self.generate_s)
        finally:
            with self.idle:
                self.running -= 1
                self.idle.notify_all()
        n = len(request.tokenized.input_ids)
        yield vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
            output_ids=[151645], finish_reason="stop", prompt_tokens=n, completion_tokens=1))


@pytest.fixture
def queueing_engine() -> Iterator[int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(QueueingEngine(generate_s=1.0), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(0).wait()


def test_probes_that_queue_behind_generation_do_not_mark_the_worker_unhealthy(queueing_engine: int) -> None:
    settings = Settings(model=bundle_path(), served_model_name=DEFAULT_MODEL,
                        worker_urls=(f"grpc://127.0.0.1:{queueing_engine}",), fetch=FetchSettings(),
                        worker_health_interval_s=0.2, worker_health_timeout_s=0.2, worker_unhealthy_after=3)
    with gateway_in_thread(settings) as base:
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        statuses: list[int] = []

        def send() -> None:
            statuses.append(httpx.post(base + "/v1/chat/completions", json=chat_body(), timeout=30).status_code)

        senders = [threading.Thread(target=send) for _ in range(3)]  # 3 s of generation, one at a time
        for t in senders:
            t.start()
        seen: list[dict[str, object]] = []
        while any(t.is_alive() for t in senders):
            seen.append(httpx.get(base + "/workers", timeout=5).json()["workers"][0])
            time.sleep(0.05)
        for t in senders:
            t.join()
        assert statuses == [200, 200, 200]
        assert all(w["healthy"] for w in seen), "the busy worker was marked unhealthy"
        # The probes really were late: every one during the 3 s was excused as busy, none counted.
        assert max(int(w["busy_probes"]) for w in seen) >= 3  # type: ignore[call-overload]
        assert all(w["consecutive_failures"] == 0 for w in seen)


# ---- the real engine: large images, and death ------------------------------------------------

def large_image_body(side: int = 2000, seed: int = 0) -> dict[str, object]:
    """A chat request with one ``side`` x ``side`` noise JPEG as a data: URL (~3 MB, under the 20 MiB cap)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=85)
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"model": DEFAULT_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]}]}


def test_large_images_on_the_one_engine_never_make_it_unhealthy(tmp_path: Path) -> None:
    args = ["--worker-health-interval", "0.25", "--worker-health-timeout", "0.5"]
    with running_stack(tmp_path, gateway_args=args) as stack:
        shm_before = shm_segments()
        bodies = [large_image_body(seed=i) for i in range(3)]
        statuses: list[int] = []
        light: list[tuple[int, str]] = []
        with HealthWatch(stack.base) as watch:
            def send(body: dict[str, object]) -> None:
                statuses.append(httpx.post(f"{stack.base}/v1/chat/completions", json=body, timeout=120).status_code)

            senders = [threading.Thread(target=send, args=(b,)) for b in bodies]
            for t in senders:
                t.start()
            seen: list[bool] = []
            with httpx.Client(timeout=10) as client:
                while any(t.is_alive() for t in senders):
                    seen.append(bool(client.get(f"{stack.base}/workers").json()["workers"][0]["healthy"]))
                    r = client.post(f"{stack.base}/v1/chat/completions", json=chat_body(), timeout=60)
                    light.append((r.status_code, r.headers.get("X-SMG-Error-Code", "")))
            for t in senders:
                t.join()
        assert statuses == [200, 200, 200]
        assert seen and all(seen), f"the busy engine was marked unhealthy in {seen.count(False)} of {len(seen)} polls"
        assert all(code != "no_healthy_worker" for _, code in light), light
        assert all(status == 200 for status, _ in light), light
        after_attack(stack, watch, statuses + [s for s, _ in light], shm_before)


def test_a_dead_engine_turns_health_503_and_a_restarted_one_back_to_200(tmp_path: Path) -> None:
    interval = 0.25
    args = ["--worker-health-interval", str(interval), "--worker-health-timeout", "0.5"]
    with running_stack(tmp_path, gateway_args=args) as stack:
        assert httpx.get(f"{stack.base}/health", timeout=5).status_code == 200
        os.killpg(stack.engine.proc.pid, signal.SIGKILL)
        stack.engine.proc.wait(timeout=10)
        killed = time.monotonic()
        health = httpx.get(f"{stack.base}/health", timeout=5)
        while health.status_code == 200 and time.monotonic() - killed < 10:
            time.sleep(0.05)
            health = httpx.get(f"{stack.base}/health", timeout=5)
        # Nothing listening is a connection-level failure: unhealthy on the next probe, no count to wait out.
        assert health.status_code == 503
        assert time.monotonic() - killed < 3 * interval + 2.5  # slack for a loaded 2-core machine
        body = health.json()
        assert body["healthy_workers"] == 0 and body["workers"] == 1
        assert body["error"]["code"] == "no_healthy_worker" and health.headers["X-SMG-Error-Code"] == "no_healthy_worker"
        worker = httpx.get(f"{stack.base}/workers", timeout=5).json()["workers"][0]
        assert worker["healthy"] is False and worker["last_probe"] == "unreachable"
        refused = httpx.post(f"{stack.base}/v1/chat/completions", json=chat_body(), timeout=10)
        assert refused.status_code == 503 and refused.headers["X-SMG-Error-Code"] == "no_healthy_worker"

        engine = start_engine(bundle_path(), log_dir=tmp_path, port=stack.engine.port)  # same port, same URL
        try:
            restarted = time.monotonic()
            while httpx.get(f"{stack.base}/health", timeout=5).status_code != 200:
                assert time.monotonic() - restarted < 15, "the restarted engine was not seen healthy"
                time.sleep(0.1)
            status, seconds = light_request(stack.base)
            assert status == 200 and seconds < 2.0
        finally:
            engine.stop()
