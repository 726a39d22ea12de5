"""Loopback servers for tests: a media origin and an in-thread gateway."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import uvicorn
from fastapi import FastAPI

from mmgate.api.app import create_app
from mmgate.gateway.state import GatewayState, build_state
from mmgate.api.server import uvicorn_config
from mmgate.cli.launch import free_port, gateway_answers
from mmgate.config.settings import Settings


@dataclass
class MediaOrigin:
    """A loopback HTTP server serving registered bodies; counts hits per path."""

    files: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    hits: Counter[str] = field(default_factory=Counter)
    port: int = 0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def add(self, path: str, body: bytes, content_type: str = "application/octet-stream") -> str:
        self.files[path] = (body, content_type)
        return self.url(path)


@contextmanager
def media_origin() -> Iterator[MediaOrigin]:
    origin = MediaOrigin()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            origin.hits[self.path] += 1
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

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    origin.port = int(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield origin
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def gateway_in_thread(settings: Settings, state: GatewayState | None = None,
                      app: FastAPI | None = None) -> Iterator[str]:
    """Run the real gateway app on loopback in a thread, under the same uvicorn config as ``mmgate serve``
    (:func:`mmgate.api.server.uvicorn_config`); yields its base URL.  ``state``: one the test built (to look
    into it while requests run); ``app``: an app the test built over it (to add a route)."""
    port = free_port()
    app = app or create_app(state or build_state(settings))
    server = uvicorn.Server(uvicorn_config(app, settings, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if gateway_answers(httpx.get(base + "/health", timeout=1)):  # 503 while no worker is healthy
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)
