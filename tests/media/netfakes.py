"""Network fakes for fetch-policy tests: no packet may leave for a non-loopback address.

* :class:`FakeResolver` answers names from a table (and counts lookups);
* :class:`FailIfCalledTransport` / :class:`FailIfCalledBackend` replace the
  HTTP transport / the socket layer and record (then fail) every call, so a
  refusal that should happen before any connection is proven to have done so
  even if the code under test swallowed the error;
* :class:`LoopbackOnlyBackend` is the socket layer for "public" test hosts:
  it connects a pinned public address to a loopback port from its table,
  optionally dials loopback literals for real, and records and refuses
  anything else (it never opens a non-loopback socket);
* :class:`LoopbackListener` is a raw TCP listener on 127.0.0.1 that counts
  accepted connections (the target of a refused loopback fetch must see none);
  ``settled()`` is the sync point before asserting that count (see there).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpcore
import httpx


@dataclass
class FakeResolver:
    """``(host, port) -> addresses`` from ``table``; unknown names fail as NXDOMAIN."""

    table: Mapping[str, list[str]]
    calls: list[str] = field(default_factory=list)

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.table[host])


@dataclass
class SequenceResolver:
    """Answers one entry of ``answers`` per lookup, the last one forever (a rebinding name)."""

    answers: list[list[str]]
    calls: list[str] = field(default_factory=list)

    async def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        return list(self.answers[min(len(self.calls) - 1, len(self.answers) - 1)])


class FailIfCalledTransport(httpx.AsyncBaseTransport):
    """An httpx transport that records each request and raises: nothing may reach it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(str(request.url))
        raise AssertionError(f"transport called for {request.url}: the request should have been refused")


class FailIfCalledBackend(httpcore.AsyncNetworkBackend):
    """A socket layer that records each connection attempt and raises."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[object] | None = None) -> httpcore.AsyncNetworkStream:
        self.calls.append((host, port))
        raise AssertionError(f"connection attempted to {host}:{port}")

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[object] | None = None) -> httpcore.AsyncNetworkStream:
        self.calls.append((path, 0))
        raise AssertionError(f"unix socket connection attempted to {path}")

    async def sleep(self, seconds: float) -> None:
        await httpcore.AnyIOBackend().sleep(seconds)


class LoopbackOnlyBackend(httpcore.AsyncNetworkBackend):
    """Connects ``(address, port)`` found in ``routes`` to ``127.0.0.1:routes[...]``; refuses the rest.

    With ``pass_loopback``, loopback and unspecified IP literals (which reach
    this machine) are connected for real, so a policy failure would show up as
    a connection at a loopback listener.  ``calls`` records every (host, port)
    the layer above asked for; ``refused`` the ones it would not dial (a test
    asserts it stays empty).
    """

    def __init__(self, routes: Mapping[tuple[str, int], int], pass_loopback: bool = False) -> None:
        self.routes = dict(routes)
        self.pass_loopback = pass_loopback
        self.calls: list[tuple[str, int]] = []
        self.refused: list[tuple[str, int]] = []
        self._inner = httpcore.AnyIOBackend()

    def _local(self, host: str) -> bool:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return ip.is_loopback or ip.is_unspecified

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[object] | None = None) -> httpcore.AsyncNetworkStream:
        self.calls.append((host, port))
        loop_port = self.routes.get((host, port))
        if loop_port is not None:
            return await self._inner.connect_tcp("127.0.0.1", loop_port, timeout=timeout)
        if self.pass_loopback and self._local(host):
            return await self._inner.connect_tcp(host, port, timeout=timeout)
        self.refused.append((host, port))
        raise httpcore.ConnectError(f"test backend: no route for {host}:{port}")

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[object] | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("test backend: no unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


@dataclass
class LoopbackListener:
    """A TCP listener on loopback that accepts, counts and closes connections."""

    port: int = 0
    accepted: int = 0
    empty_polls: int = 0  # accept() calls that found the backlog empty (the accept loop's progress)
    polled: threading.Condition = field(default_factory=threading.Condition)

    def settled(self, timeout_s: float = 5.0) -> int:
        """``accepted`` once every connection made before this call has been accepted.

        A client's ``connect()`` returns once the kernel has queued the connection, so any
        connection the code under test made before answering is in the backlog by the time its
        answer is read.  Two empty polls of the accept loop after this call (the first may have
        begun before it) prove the backlog was drained: the positive sync point that an
        assertion of "no connection" needs, instead of a sleep.

        Raises:
            AssertionError: the accept loop made no progress within ``timeout_s``.
        """
        with self.polled:
            start = self.empty_polls
            if not self.polled.wait_for(lambda: self.empty_polls >= start + 2, timeout=timeout_s):
                raise AssertionError(f"listener on port {self.port}: accept loop stalled for {timeout_s}s")
            return self.accepted


@contextmanager
def loopback_listener(host: str = "127.0.0.1", port: int = 0) -> Iterator[LoopbackListener]:
    """Listen on ``host:port`` (``port`` 0: any free port); raises OSError when it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(16)
    sock.settimeout(0.05)
    listener = LoopbackListener(port=int(sock.getsockname()[1]))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except (TimeoutError, OSError):
                with listener.polled:
                    listener.empty_polls += 1
                    listener.polled.notify_all()
                continue
            listener.accepted += 1
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener
    finally:
        stop.set()
        thread.join(timeout=5)
        sock.close()
