"""One child of ``mmgate serve --workers N``: a complete gateway on a socket its parent bound.

Stage: process start-up.  In: ``python -m mmgate.api.serve_child --index I --parent-pid P
--listen-fd F --ready-fd R --life-fd L --metrics-dir D -- <serve arguments>`` from
:class:`mmgate.api.multiproc.Supervisor`, with a ``SO_REUSEPORT`` socket (not listening yet)
on descriptor F; out: the gateway (``build_state`` + ``create_app`` + uvicorn, the same limits as
``mmgate serve``) serving that socket, one ``R`` written on R once it listens and its app has
started, and an exit when the parent goes.

Invariants:

* it never outlives its parent: ``PR_SET_PDEATHSIG`` = SIGTERM (Linux), and a thread blocked
  on L, a pipe only the parent can write to, that at end-of-file stops the server gracefully
  and exits hard :data:`~mmgate.api.multiproc.ORPHAN_GRACE_S` seconds later;
* its preprocessing pool is its share of the cores when ``--preprocess-threads`` is 0
  (:func:`process_settings`);
* every response carries ``X-Mmgate-Process: <pid>``; ``GET /metrics`` answers the sum over
  every process in D (prometheus_client multiprocess mode: the parent also sets
  ``PROMETHEUS_MULTIPROC_DIR`` = D in this process's environment, which prometheus_client reads
  when it is imported).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from mmgate.api.multiproc import ORPHAN_GRACE_S, PROCESS_HEADER
from mmgate.config.settings import Settings, parse_settings

log = logging.getLogger("mmgate.multiproc")


class ProcessTag:
    """ASGI middleware: ``X-Mmgate-Process: <pid>`` on every response, and ``GET /metrics`` answered
    with the sum over every process's metrics files in ``metrics_dir`` (when set)."""

    def __init__(self, app: Any, metrics_dir: str) -> None:
        self.app = app
        self.metrics_dir = metrics_dir
        self.tag = (PROCESS_HEADER.encode(), str(os.getpid()).encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.metrics_dir and scope["path"] == "/metrics" and scope["method"] == "GET":
            await self._metrics(send)
            return

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.tag]}
            await send(message)

        await self.app(scope, receive, tagged)

    async def _metrics(self, send: Any) -> None:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.metrics_dir)
        body = generate_latest(registry)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", CONTENT_TYPE_LATEST.encode()), (b"content-length", str(len(body)).encode()), self.tag]})
        await send({"type": "http.response.body", "body": body})


class ReadyServer(uvicorn.Server):
    """uvicorn's server that writes ``R`` on ``ready_fd`` once its sockets listen and its app started."""

    def __init__(self, config: uvicorn.Config, ready_fd: int) -> None:
        super().__init__(config)
        self.ready_fd = ready_fd

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.ready_fd >= 0:
            os.write(self.ready_fd, b"R")
            os.close(self.ready_fd)
            self.ready_fd = -1


def set_parent_death_signal() -> None:
    """``prctl(PR_SET_PDEATHSIG, SIGTERM)``: the kernel sends SIGTERM when the parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG


def watch_parent(life_fd: int, stop: Callable[[], None]) -> None:
    """Block on the life pipe; at end-of-file (the parent is gone) call ``stop()``, then exit hard after
    :data:`~mmgate.api.multiproc.ORPHAN_GRACE_S`.  Runs in a daemon thread."""
    try:
        while os.read(life_fd, 1):
            pass
    except OSError:
        pass
    log.warning("the parent process is gone: stopping")
    stop()
    time.sleep(ORPHAN_GRACE_S)
    os._exit(1)


def process_settings(settings: Settings, cpus: int) -> Settings:
    """The settings of one of ``settings.processes`` processes: ``--preprocess-threads 0`` (one thread per
    core) becomes the process's share of the cores, ``ceil(cpus / processes)``, so N processes start about
    ``cpus`` preprocessing threads in all, not N x ``cpus``."""
    if settings.preprocess_threads:
        return settings
    return dataclasses.replace(settings, preprocess_threads=max(1, -(-cpus // settings.processes)))


def main(argv: Sequence[str]) -> int:
    """Run one child (see the module docstring); 0 after a clean stop, 1 when it did not start, 2 on a
    bad model."""
    ap = argparse.ArgumentParser(prog="mmgate.api.serve_child")
    for name in ("--index", "--parent-pid", "--listen-fd", "--ready-fd", "--life-fd"):
        ap.add_argument(name, type=int, required=True)
    ap.add_argument("--metrics-dir", default="", help="the folder of the multiprocess metrics ('' : per process)")
    ap.add_argument("serve_argv", nargs=argparse.REMAINDER)
    spec = ap.parse_args(list(argv))
    set_parent_death_signal()
    if os.getppid() != spec.parent_pid:
        return 1  # the parent died before the death signal was armed
    server: ReadyServer | None = None

    def stop() -> None:
        if server is None:
            os._exit(1)  # still loading: nothing to finish
        server.should_exit = True

    threading.Thread(target=watch_parent, args=(spec.life_fd, stop), daemon=True, name="mmgate-parent").start()

    from mmgate.api.app import create_app
    from mmgate.config.cores import available_cores
    from mmgate.gateway.state import build_state
    from mmgate.api.server import uvicorn_config
    from mmgate.errors import GatewayError

    serve_argv = spec.serve_argv[1:] if spec.serve_argv[:1] == ["--"] else spec.serve_argv
    settings = process_settings(parse_settings(serve_argv, os.environ), available_cores())
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [{os.getpid()}] %(name)s: %(message)s")
    sock = socket.socket(fileno=spec.listen_fd)
    try:
        state = build_state(settings)
    except GatewayError as exc:
        print(f"mmgate: {exc.message}", file=sys.stderr)
        return 2
    app = ProcessTag(create_app(state), spec.metrics_dir)
    server = ReadyServer(uvicorn_config(app, settings), spec.ready_fd)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    return 0 if server.started else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
