"""A scripted loopback media origin: each path answers with a :class:`Behavior`.

Covers what the edge-case corpus asks of its test server (content types,
status codes, a stall after the headers, a slow drip, an oversized body, a
redirect loop, ``/redirect?to=URL``) and records what happened: hits and
``Host`` headers per path, and how many body bytes were written.
``settled()`` is the sync point before asserting that a path saw no hit.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from tests.support.settle import POLL_INTERVAL_S, CountingServer, ReadCounting, SettleCounts


@dataclass(frozen=True)
class Behavior:
    """How the origin answers one path."""

    body: bytes = b""
    status: int = 200
    content_type: str | None = "application/octet-stream"  # None: no Content-Type header
    stall_s: float = 0.0  # sleep after the headers, before the body
    bytes_per_second: float = 0.0  # > 0: drip the body at this rate
    pad_to: int = 0  # > 0: body padded with zeros to this size, sent without Content-Length
    redirect_to: str | None = None  # Location of a 302


@dataclass
class ScriptedOrigin(SettleCounts):
    behaviors: dict[str, Behavior] = field(default_factory=dict)
    hits: Counter[str] = field(default_factory=Counter)
    host_headers: list[str] = field(default_factory=list)
    bytes_sent: Counter[str] = field(default_factory=Counter)
    port: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def settled(self, timeout_s: float = 5.0) -> Counter[str]:
        """``hits`` once every connection made before this call has been accepted and its request read.

        A client's ``connect()`` returns once the kernel has queued the connection, so a fetch the
        code under test began before answering is queued by the time its answer is read.  Two
        accept-loop passes after this call (the first may have begun before it) accept what was
        queued; then each accepted connection's request line has been read (its hit counted) or the
        connection closed.  The positive sync point an assertion of "no hit" needs, not a sleep.

        Raises:
            AssertionError: the accept loop or a connection's first request stalled past ``timeout_s``.
        """
        return self._settled(lambda: Counter(self.hits), f"origin on port {self.port}", timeout_s)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def add(self, path: str, behavior: Behavior) -> str:
        self.behaviors[path] = behavior
        return self.url(path)


class _Handler(ReadCounting):
    origin: ScriptedOrigin  # set on the subclass

    def log_message(self, *args: object) -> None:
        pass

    def _write(self, path: str, data: bytes) -> None:
        self.wfile.write(data)
        self.origin.bytes_sent[path] += len(data)

    def do_GET(self) -> None:
        origin = self.origin
        parts = urlsplit(self.path)
        origin.hits[parts.path] += 1
        origin.host_headers.append(self.headers.get("Host", ""))
        self._mark_read()
        if parts.path == "/redirect":
            target = parse_qs(parts.query).get("to", [""])[0]
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        behavior = origin.behaviors.get(parts.path)
        if behavior is None:
            self.send_error(404)
            return
        self.send_response(behavior.status)
        if behavior.redirect_to is not None:
            self.send_header("Location", behavior.redirect_to)
        if behavior.content_type is not None:
            self.send_header("Content-Type", behavior.content_type)
        body = behavior.body
        if behavior.pad_to:
            self.send_header("Connection", "close")
        else:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self._send_body(parts.path, behavior, body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _send_body(self, path: str, behavior: Behavior, body: bytes) -> None:
        origin = self.origin
        if behavior.stall_s and origin.stop.wait(behavior.stall_s):
            return
        if behavior.bytes_per_second:
            for i in range(len(body)):
                self._write(path, body[i:i + 1])
                self.wfile.flush()
                if origin.stop.wait(1.0 / behavior.bytes_per_second):
                    return
            return
        self._write(path, body)
        if behavior.pad_to:
            chunk = b"\0" * 65536
            remaining = behavior.pad_to - len(body)
            while remaining > 0 and not origin.stop.is_set():
                self._write(path, chunk[:remaining])
                remaining -= len(chunk)


@contextmanager
def scripted_origin() -> Iterator[ScriptedOrigin]:
    origin = ScriptedOrigin()
    handler = type("Handler", (_Handler,), {"origin": origin})
    server = CountingServer(("127.0.0.1", 0), handler)
    server.origin = origin
    server.daemon_threads = True
    server.block_on_close = False
    origin.port = int(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": POLL_INTERVAL_S}, daemon=True)
    thread.start()
    try:
        yield origin
    finally:
        origin.stop.set()
        server.shutdown()
        server.server_close()
        time.sleep(0.05)
