"""Loopback servers for tests: a media origin and an in-thread gateway."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI

from mmgate.api.app import create_app
from mmgate.gateway.state import GatewayState, build_state
from mmgate.api.server import uvicorn_config
from mmgate.cli.launch import free_port, gateway_answers
from mmgate.config.settings import Settings
from tests.support.settle import POLL_INTERVAL_S, CountingServer, ReadCounting, SettleCounts


@dataclass
class MediaOrigin(SettleCounts):
    """A loopback HTTP server serving registered bodies; counts hits per path.

    ``settled()`` is the sync point before asserting that a path saw no hit.
    """

    files: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    hits: Counter[str] = field(default_factory=Counter)
    port: int = 0

    def settled(self, timeout_s: float = 5.0) -> Counter[str]:
        """``hits`` once every connection made before this call has been accepted and its request read.

        A fetch the code under test began before answering is in the kernel's accept queue by the
        time its answer is read; two accept-loop passes after this call accept it, then its request
        line is read (its hit counted) or the connection closed (see :mod:`tests.support.settle`).

        Raises:
            AssertionError: the accept loop or a connection's first request stalled past ``timeout_s``.
        """
        return self._settled(lambda: Counter(self.hits), f"media origin on port {self.port}", timeout_s)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def add(self, path: str, body: bytes, content_type: str = "application/octet-stream") -> str:
        self.files[path] = (body, content_type)
        return self.url(path)


@contextmanager
def media_origin() -> Iterator[MediaOrigin]:
    origin = MediaOrigin()

    class Handler(ReadCounting):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            origin.hits[self.path] += 1
            self._mark_read()
            entry = origin.files.get(self.path)
            if entry is None:
                self.send_error(404)
                return
            body, ctype = entry
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    Handler.origin = origin
    server = CountingServer(("127.0.0.1", 0), Handler)
    server.origin = origin
    origin.port = int(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": POLL_INTERVAL_S}, daemon=True)
    thread.start()
    try:
        yield origin
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def gateway_in_thread(settings: Settings, state: GatewayState | None = None,
                      app: FastAPI | None = None, health_headers: dict[str, str] | None = None) -> Iterator[str]:
    """Run the real gateway app on loopback in a thread, under the same uvicorn config as ``mmgate serve``
    (:func:`mmgate.api.server.uvicorn_config`); yields its base URL.  ``state``: one the test built (to look
    into it while requests run); ``app``: an app the test built over it (to add a route); ``health_headers``:
    sent with the readiness polls of ``/health`` (a key, under ``--protect-ops``)."""
    port = free_port()
    app = app or create_app(state or build_state(settings))
    server = uvicorn.Server(uvicorn_config(app, settings, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            # 503 while no worker is healthy
            if gateway_answers(httpx.get(base + "/health", headers=health_headers, timeout=1)):
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)
