"""Start the reference engine and the gateway as child processes on loopback.

Used by the quick start (``mmgate demo``), the end-to-end tests and the
benchmarks, so that all three start things the same way.  Each process is
started in its own session and stopped with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_pids(root: int) -> set[int]:
    """``root`` and every live descendant of it (Linux: ``/proc/<pid>/task/*/children``); a process
    that exits while it is read is left out.  Used by the tests' shared-memory scope and the
    benchmarks' per-tree CPU and RSS readings."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except OSError:
            continue
    return seen


@dataclass
class Child:
    """A started child process and where it listens."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path | None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]


def _spawn(name: str, args: Sequence[str], port: int, log_dir: Path | None, env: Mapping[str, str] | None) -> Child:
    log_path = (log_dir / f"{name}-{port}.log") if log_dir else None
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True, env=full_env)
    return Child(name=name, proc=proc, port=port, log_path=log_path)


def wait_grpc_health(child: Child, timeout_s: float = 180.0) -> None:
    """Wait until the engine says healthy, whichever engine service it serves (the engine seam's detection,
    :func:`mmgate.engines.probe.healthy_sync`); raises RuntimeError with its log on failure."""
    import grpc

    from mmgate.engines.probe import healthy_sync

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{child.port}") as channel:
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited ({child.proc.returncode}):\n{child.log_tail()}")
            if healthy_sync(channel, timeout_s=1.0):
                return
            time.sleep(0.25)
    raise RuntimeError(f"{child.name} did not become healthy in {timeout_s}s:\n{child.log_tail()}")


def gateway_answers(response: httpx.Response, want_workers: int = 0) -> bool:
    """Whether a ``/health`` answer shows a running gateway with ``want_workers`` healthy workers.

    ``/health`` is 503 while no worker is healthy; with ``want_workers == 0`` that answer counts too
    (a gateway started without workers, or before any is up, is running).
    """
    if response.status_code not in (200, 503):
        return False
    try:
        healthy = response.json().get("healthy_workers")
    except ValueError:
        return False
    return isinstance(healthy, int) and healthy >= want_workers


def wait_http_health(child: Child, timeout_s: float = 60.0, want_workers: int = 0) -> None:
    """Wait until the gateway's /health answers and reports ``want_workers`` healthy workers
    (see :func:`gateway_answers`).

    Raises:
        RuntimeError: the gateway exited, or did not get there in ``timeout_s`` seconds (its log attached).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited ({child.proc.returncode}):\n{child.log_tail()}")
        try:
            if gateway_answers(httpx.get(f"http://127.0.0.1:{child.port}/health", timeout=1.0), want_workers):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{child.name} did not become healthy in {timeout_s}s:\n{child.log_tail()}")


def start_engine(model: str, extra: Sequence[str] = (), log_dir: Path | None = None,
                 env: Mapping[str, str] | None = None, port: int | None = None) -> Child:
    """Start ``mmgate engine`` on 127.0.0.1 and wait for its HealthCheck."""
    port = port or free_port()
    child = _spawn("engine", ["mmgate.refengine", "--model", model, "--host", "127.0.0.1", "--port", str(port), *extra],
                   port, log_dir, env)
    try:
        wait_grpc_health(child)
    except BaseException:
        child.stop()
        raise
    return child


def wait_processes(child: Child, processes: int, want_workers: int = 0, timeout_s: float = 60.0) -> None:
    """Wait until ``processes`` distinct processes of a ``--workers`` gateway each answered ``/health`` with
    ``want_workers`` healthy workers (told apart by their ``X-Mmgate-Process`` header; each probe opens a new
    connection, which the kernel hands to one of the ``SO_REUSEPORT`` sockets).

    Raises:
        RuntimeError: the gateway exited, or not every process answered in ``timeout_s`` seconds.
    """
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited ({child.proc.returncode}):\n{child.log_tail()}")
        try:
            r = httpx.get(f"http://127.0.0.1:{child.port}/health", timeout=1.0)
            if gateway_answers(r, want_workers) and r.headers.get("x-mmgate-process"):
                seen.add(r.headers["x-mmgate-process"])
        except httpx.HTTPError:
            pass
        if len(seen) >= processes:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{child.name}: {len(seen)} of {processes} processes answered in {timeout_s}s:\n"
                       f"{child.log_tail()}")


def start_gateway(model: str, worker_ports: Sequence[int], extra: Sequence[str] = (), log_dir: Path | None = None,
                  env: Mapping[str, str] | None = None, port: int | None = None, processes: int = 1) -> Child:
    """Start ``mmgate serve`` on 127.0.0.1 and wait until every worker is healthy.

    ``processes`` > 1: ``--workers processes``, and the wait lasts until every gateway process answered
    (:func:`wait_processes`).
    """
    port = port or free_port()
    urls = [f"grpc://127.0.0.1:{p}" for p in worker_ports]
    args = ["mmgate.cli", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--log-level",
            "warning"]
    if urls:
        args += ["--worker-urls", *urls]
    if processes > 1:
        args += ["--workers", str(processes)]
    child = _spawn("gateway", [*args, *extra], port, log_dir, env)
    try:
        wait_http_health(child, want_workers=len(urls))
        if processes > 1:
            wait_processes(child, processes, want_workers=len(urls))
    except BaseException:
        child.stop()
        raise
    return child
