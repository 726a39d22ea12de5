"""A worker whose bundle cannot be had is tried again, with a backoff, and admitted once it can be (issue 25).

A reference engine (Gemma 3) on loopback; a gateway without ``--model``, with an empty model search path and
a bundle source that refuses until the test lets it through (then it gives the engine's bundle folder), probing
every 0.2 s.

* While refused: ``/health`` is 503 ``no_healthy_worker`` with ``healthy_workers`` 0 (the worker answers its
  probes but cannot take traffic); ``GET /workers`` shows it ``failed`` with the source's reason and when it is
  tried next.
* Once the bundle can be had: without a restart, a later probe round admits it; ``/health`` turns 200 with
  one healthy worker, ``GET /workers`` shows it ``ready`` with no reason, and the ``openai`` client is answered.
* The backoff rule (one probe interval, doubled per failure in a row, at most 60 s), values written out.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mmgate.config.settings import parse_settings
from mmgate.gateway.state import build_state
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from mmgate.routing.workers import HealthPolicy, Worker, WorkerRegistry
from tests.conftest import bundle_dir
from tests.support.servers import gateway_in_thread

GEMMA = "google/gemma-3-4b-it"
REASON = "the bundle is not published yet"


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningEngine]:
    running = start_engine(EngineConfig(model=bundle_dir(GEMMA), port=0, served_model_name=GEMMA))
    yield running
    running.stop(grace=0)


def _wait_for(check: Any, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``check()`` until true (a sync point on the gateway's state, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class GatedSource:
    """A bundle source that refuses until ``open`` is set, then gives the worker's bundle folder."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.calls = 0

    async def __call__(self, worker: Worker) -> Path:
        self.calls += 1
        if not self.open.is_set():
            raise LookupError(REASON)
        return bundle_dir(GEMMA)


def test_a_failed_worker_is_retried_and_admitted_once_its_bundle_can_be_had(engine: RunningEngine) -> None:
    source = GatedSource()
    with tempfile.TemporaryDirectory(prefix="mmgate-no-bundles-") as empty:
        settings = parse_settings(["--worker-urls", f"grpc://{engine.address}", "--model-path", empty,
                                   "--worker-health-interval", "0.2"], {})
        with gateway_in_thread(settings, build_state(settings, bundles=source)) as base:
            def worker() -> dict[str, Any]:
                (only,) = httpx.get(base + "/workers", timeout=10).json()["workers"]
                return only

            health = httpx.get(base + "/health", timeout=10)
            assert health.status_code == 503 and health.headers["X-SMG-Error-Code"] == "no_healthy_worker"
            assert (health.json()["healthy_workers"], health.json()["workers"]) == (0, 1)
            _wait_for(lambda: worker()["status"] == "failed" and worker()["admit_failures"] >= 2,
                      "a second failed admission")
            shown = worker()
            assert (shown["model_id"], shown["healthy"], shown["reason"]) == (GEMMA, True, f"LookupError: {REASON}")
            assert shown["next_admit_in_s"] is not None and shown["next_admit_in_s"] >= 0
            assert httpx.get(base + "/v1/models", timeout=10).json()["data"] == []

            source.open.set()
            _wait_for(lambda: httpx.get(base + "/health", timeout=10).status_code == 200, "the worker's admission")
            assert httpx.get(base + "/health", timeout=10).json()["healthy_workers"] == 1
            shown = worker()
            assert (shown["status"], shown["reason"], shown["admit_failures"], shown["next_admit_in_s"]) == (
                "ready", "", 0, None)
            assert [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]] == [GEMMA]
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
            out = client.chat.completions.create(model=GEMMA, max_tokens=3, temperature=0,
                                                 messages=[{"role": "user", "content": "Say something."}])
            assert out.model == GEMMA and out.usage is not None and out.usage.completion_tokens == 3
    assert source.calls >= 3  # two refusals, then the admission


def test_the_retry_backoff_doubles_from_one_probe_interval_up_to_60_s() -> None:
    registry = WorkerRegistry([], HealthPolicy(interval_s=5.0))
    assert [registry.retry_delay_s(n) for n in range(1, 8)] == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    fast = WorkerRegistry([], HealthPolicy(interval_s=0.2))
    assert [fast.retry_delay_s(n) for n in (1, 2, 3, 100)] == [0.2, 0.4, 0.8, 60.0]
