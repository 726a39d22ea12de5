"""The worker-mode stack: Redis, two reference engines, one sidecar, three gateways.

* ``redis-server`` on a free loopback port, temporary folder, no persistence,
  ``proto-max-bulk-len 1mb`` (so the sidecar's result limit is lowered to 1 MiB);
* engine ``inprocess`` (``--mm-processor inprocess``) and engine ``redis``
  (``--mm-processor redis``, namespace ``wm``, 3 s sidecar timeout), both
  recording their model inputs (``--record-dir``);
* ``mmgate sidecar`` in namespace ``wm`` with a 2 s hello TTL refreshed every
  0.5 s (defaults 15 s / 5 s);
* in-thread gateways: ``router`` (router mode -> engine inprocess),
  ``inprocess`` (worker mode -> engine inprocess), ``sidecar`` (worker mode ->
  engine redis).

Engines, sidecar and gateways share one fetch policy (:data:`FLAGS`): loopback
origins allowed, allow-list ``127.0.0.1``, 1.5 s total fetch timeout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from mmgate.cli.launch import Child, start_engine
from mmgate.config.settings import FetchSettings, MmProcessing, Settings
from tests.conftest import bundle_dir
from tests.worker_mode.support import (
    MODEL,
    Gateway,
    Origin,
    Proc,
    RedisServer,
    gateway,
    origin,
    sidecar_args,
    spawn,
    start_redis,
    wait_for,
)

NAMESPACE = "wm"
HELLO_TTL_S = 2.0
SIDECAR_TIMEOUT_MS = 3000
FLAGS = ["--mm-allow-private-media-hosts", "--mm-allowed-media-domains", "127.0.0.1", "--mm-fetch-timeout", "1.5"]
FETCH = FetchSettings(allow_private_hosts=True, allowed_domains=("127.0.0.1",), total_timeout_s=1.5)


@dataclass
class Stack:
    bundle: Path
    logs: Path
    redis: RedisServer
    inprocess: Child
    redis_engine: Child
    records: dict[str, Path]  # gateway name -> the record folder of the engine behind it
    sidecar: Proc | None = None

    def hello_key(self, namespace: str = NAMESPACE) -> str:
        return f"smg:mm:v1:{namespace}:hello"

    def start_sidecar(self, *extra: str, name: str = "sidecar") -> Proc:
        args = sidecar_args(self.bundle, self.redis.url, "--namespace", NAMESPACE, "--hello-ttl-s", str(HELLO_TTL_S),
                            "--hello-refresh-s", "0.5", *FLAGS, *extra)
        return spawn(name, args, self.logs)

    def ensure_sidecar(self) -> Proc:
        """The sidecar, restarted if a test stopped it; waits until its hello lives."""
        if self.sidecar is None or not self.sidecar.alive():
            self.sidecar = self.start_sidecar()
        sidecar = self.sidecar
        client = self.redis.client()
        wait_for(lambda: client.exists(self.hello_key()) == 1 or not sidecar.alive(), 120, "the sidecar's hello")
        assert sidecar.alive(), sidecar.tail()
        return sidecar


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("worker_mode")
    logs = root / "logs"
    logs.mkdir()
    bundle = bundle_dir(MODEL)
    redis_server = start_redis(root / "redis", "--proto-max-bulk-len", "1mb")
    records = {"inprocess": root / "rec-inprocess", "redis": root / "rec-redis"}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    redis_flags = ["--mm-processor", "redis", "--mm-redis-url", redis_server.url, "--mm-sidecar-namespace", NAMESPACE,
                   "--mm-sidecar-timeout-ms", str(SIDECAR_TIMEOUT_MS), "--mm-sidecar-max-queue", "8"]
    stack_ = None
    try:
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(start_engine, str(bundle), ["--mm-processor", "inprocess", *FLAGS, "--record-dir",
                                                        str(records["inprocess"])], logs, env)
            b = pool.submit(start_engine, str(bundle), [*redis_flags, *FLAGS, "--record-dir", str(records["redis"])],
                            logs, env)
            partial = Stack(bundle, logs, redis_server, None, None, {})  # type: ignore[arg-type]
            partial.sidecar = partial.start_sidecar()
            inprocess, redis_engine = a.result(), b.result()
        stack_ = Stack(bundle, logs, redis_server, inprocess, redis_engine,
                       {"router": records["inprocess"], "inprocess": records["inprocess"], "sidecar": records["redis"]},
                       partial.sidecar)
        stack_.ensure_sidecar()
        yield stack_
    finally:
        if stack_ is not None:
            for child in (stack_.inprocess, stack_.redis_engine):
                child.stop()
            if stack_.sidecar is not None:
                stack_.sidecar.stop()
        redis_server.proc.stop()


@pytest.fixture(scope="session")
def media() -> Iterator[Origin]:
    with origin() as o:
        yield o


def _settings(engine: Child, mode: MmProcessing, model: str = MODEL, bundle: Path | None = None) -> Settings:
    return Settings(model=str(bundle or bundle_dir(model)), served_model_name=model, fetch=FETCH, mm_processing=mode,
                    worker_urls=(f"grpc://127.0.0.1:{engine.port}",))


@dataclass
class Workers:
    """One bundle's two worker-mode paths: an ``inprocess`` engine, and a ``redis`` engine with its sidecar.

    Both engines record their model inputs; the sidecar shares the session's
    ``redis-server`` under its own namespace.
    """

    model: str  # the served model name
    bundle: Path
    inprocess: Child
    redis_engine: Child
    sidecar: Proc
    records: dict[str, Path]  # "inprocess" | "sidecar" -> the record folder of the engine on that path

    def stop(self) -> None:
        for child in (self.inprocess, self.redis_engine):
            child.stop()
        self.sidecar.stop()


def start_workers(model: str, bundle: Path, namespace: str, redis_server: RedisServer, root: Path) -> Workers:
    """Start both paths for ``bundle`` (in parallel) and wait for the sidecar's hello.

    Raises:
        RuntimeError / AssertionError: a process did not come up (its log in the message).
    """
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    records = {"inprocess": root / "rec-inprocess", "sidecar": root / "rec-redis"}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    redis_flags = ["--mm-processor", "redis", "--mm-redis-url", redis_server.url, "--mm-sidecar-namespace", namespace,
                   "--mm-sidecar-timeout-ms", str(SIDECAR_TIMEOUT_MS)]
    sidecar = spawn(f"sidecar-{namespace}", sidecar_args(bundle, redis_server.url, "--namespace", namespace, *FLAGS),
                    logs)
    started: list[Child] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start_engine, str(bundle), ["--mm-processor", "inprocess", *FLAGS, "--record-dir",
                                                               str(records["inprocess"])], logs, env),
                       pool.submit(start_engine, str(bundle), [*redis_flags, *FLAGS, "--record-dir",
                                                               str(records["sidecar"])], logs, env)]
            errors = [f.exception() for f in futures]
            started.extend(f.result() for f, e in zip(futures, errors) if e is None)
        for error in errors:
            if error is not None:
                raise error
        client = redis_server.client()
        hello = f"smg:mm:v1:{namespace}:hello"
        wait_for(lambda: client.exists(hello) == 1 or not sidecar.alive(), 120, "the sidecar's hello")
        assert sidecar.alive(), sidecar.tail()
    except BaseException:
        for child in started:
            child.stop()
        sidecar.stop()
        raise
    return Workers(model, bundle, started[0], started[1], sidecar, records)


@contextmanager
def worker_gateways(workers: Workers) -> Iterator[dict[str, Gateway]]:
    """Worker-mode gateways in front of each path; yields once the redis engine advertises its sidecar."""
    with gateway(_settings(workers.inprocess, MmProcessing.WORKER, workers.model, workers.bundle)) as inprocess, \
            gateway(_settings(workers.redis_engine, MmProcessing.WORKER, workers.model, workers.bundle)) as sidecar:
        wait_for(lambda: sidecar.labels()[0].get("mm_processor") == "redis", 30, "mm_processor=redis")
        wait_for(lambda: inprocess.labels()[0].get("mm_processor") == "inprocess", 30, "mm_processor=inprocess")
        yield {"inprocess": inprocess, "sidecar": sidecar}


@pytest.fixture(scope="session")
def gateways(stack: Stack) -> Iterator[dict[str, Gateway]]:
    with gateway(_settings(stack.inprocess, MmProcessing.ROUTER)) as router, \
            gateway(_settings(stack.inprocess, MmProcessing.WORKER)) as inprocess, \
            gateway(_settings(stack.redis_engine, MmProcessing.WORKER)) as sidecar:
        yield {"router": router, "inprocess": inprocess, "sidecar": sidecar}


@pytest.fixture
def live(stack: Stack, gateways: dict[str, Gateway]) -> Stack:
    """The stack with a live sidecar that the redis engine advertises (and its gateway has seen)."""
    stack.ensure_sidecar()
    wait_for(lambda: gateways["sidecar"].labels()[0].get("mm_processor") == "redis", 30, "mm_processor=redis")
    return stack
