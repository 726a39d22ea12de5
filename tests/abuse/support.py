"""Shared parts of the abuse suite: a real engine + gateway on loopback, and the checks every attack ends with.

Each attack test (``tests/abuse/test_*.py``) runs a bounded attack (a few hundred requests at most,
loopback only) against ``mmgate serve`` + ``mmgate engine`` started as child processes, while a
:class:`HealthWatch` polls ``/health``; afterwards :func:`after_attack` asserts what issue 15 asks of
every attack: ``/health`` answered within 1 s throughout, a light request completes within 2 s, no 500
was seen, no shared-memory segment is left, and the gateway's RSS is back near its idle value.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mmgate.cli.launch import Child, start_engine, start_gateway
from tests.support.shm_scope import leftover_segments, own_segments

DEFAULT_MODEL = "Qwen/Qwen2-VL-2B-Instruct"


def bundle_path(name: str = DEFAULT_MODEL) -> str:
    from tests.conftest import bundle_dir

    return str(bundle_dir(name))


@dataclass
class Stack:
    """A running reference engine and gateway; ``base`` is the gateway's URL."""

    engine: Child
    gateway: Child
    model: str

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"


@contextmanager
def running_stack(log_dir: Path, model: str = DEFAULT_MODEL, gateway_args: Sequence[str] = (),
                  engine_args: Sequence[str] = ()) -> Iterator[Stack]:
    """Start ``mmgate engine`` and ``mmgate serve`` (loopback) and stop both afterwards."""
    path = bundle_path(model)
    engine = start_engine(path, extra=list(engine_args), log_dir=log_dir)
    try:
        gateway = start_gateway(path, [engine.port], extra=["--served-model-name", model, *gateway_args],
                                log_dir=log_dir)
    except BaseException:
        engine.stop()
        raise
    try:
        yield Stack(engine=engine, gateway=gateway, model=model)
    finally:
        gateway.stop()
        engine.stop()


def chat_body(model: str = DEFAULT_MODEL, text: str = "Say one word.", max_tokens: int = 1,
              **extra: object) -> dict[str, object]:
    """A light text-only chat request."""
    return {"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}], **extra}


def light_request(base: str, model: str = DEFAULT_MODEL, timeout_s: float = 10.0) -> tuple[int, float]:
    """Status and seconds of one light chat request."""
    start = time.perf_counter()
    r = httpx.post(f"{base}/v1/chat/completions", json=chat_body(model), timeout=timeout_s)
    return r.status_code, time.perf_counter() - start


@dataclass
class HealthWatch:
    """Polls ``GET /health`` every ``interval_s`` in a thread; keeps the slowest answer and any failure."""

    base: str
    interval_s: float = 0.2
    worst_s: float = 0.0
    polls: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _first: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    client.get(f"{self.base}/health")
                except httpx.HTTPError as exc:
                    self.failures.append(type(exc).__name__)
                self.worst_s = max(self.worst_s, time.perf_counter() - start)
                self.polls += 1
                self._first.set()
                self._stop.wait(self.interval_s)

    def __enter__(self) -> HealthWatch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._first.wait(timeout=5.0)  # the attack starts once /health has been seen answering
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=10)


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (``/proc/PID/status`` VmRSS)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


def shm_segments() -> set[str]:
    """mmgate's shared-memory segments present now, of this test's processes (:mod:`tests.support.shm_scope`)."""
    return own_segments()


def after_attack(stack: Stack, watch: HealthWatch, statuses: Sequence[int], shm_before: set[str],
                 idle_rss_mb: float | None = None, rss_slack: float = 0.10, rss_settle_s: float = 10.0) -> None:
    """The checks every attack ends with (see the module docstring).

    ``idle_rss_mb``: the gateway's RSS before the attack; when given, RSS must come back within
    ``rss_slack`` of it (plus 32 MiB for small processes) within ``rss_settle_s`` seconds.
    """
    assert watch.polls > 0
    assert not watch.failures, f"/health failed during the attack: {watch.failures[:5]}"
    assert watch.worst_s < 1.0, f"/health took {watch.worst_s:.2f}s during the attack"
    assert 500 not in statuses, "a 500 during the attack"
    status, seconds = light_request(stack.base, stack.model)
    assert status == 200, f"light request after the attack: {status}"
    assert seconds < 2.0, f"light request after the attack took {seconds:.2f}s"
    assert not leftover_segments(shm_before, 5.0), "shared-memory segments left behind"
    if idle_rss_mb is not None:
        limit = idle_rss_mb * (1 + rss_slack) + 32.0
        deadline = time.monotonic() + rss_settle_s
        now = rss_mb(stack.gateway.proc.pid)
        while now > limit and time.monotonic() < deadline:
            time.sleep(0.5)
            now = rss_mb(stack.gateway.proc.pid)
        assert now <= limit, f"gateway RSS {now:.0f} MiB after the attack, idle was {idle_rss_mb:.0f} MiB"
