"""The HTTP server under the app: uvicorn with mmgate's connection limits.

Stage: before any route runs.  In: TCP connections on the gateway's port.
Out: ASGI requests for the app, or a refusal rendered from the error table.

uvicorn (0.5x) bounds the time between two requests on a kept-alive connection
(``timeout_keep_alive``) but nothing else: a connection whose request line and
headers never complete is held forever, and ``limit_concurrency`` answers plain
text.  :class:`GuardedH11Protocol` (h11, the default parser) and
:class:`GuardedHttpToolsProtocol` (``--http-parser httptools``) add, per connection:

* a header deadline (``--http-header-timeout``), armed on connect and again on
  the first byte after each response, cancelled when the headers are complete:
  past it, a connection that sent part of a request gets 408 ``request_timeout``
  and is closed; one that sent nothing is closed silently (an idle pre-connect);
* a connection cap (``--max-connections``): a request on a connection opened
  past it gets 503 ``server_busy`` with ``Connection: close``;
* uvicorn's 400 for an unparsable request (including headers past 16 KiB before
  their end: h11's bound on an incomplete event; :class:`GuardedHttpToolsProtocol`
  counts the request line + headers for llhttp, which has no bound)
  rendered as the error body ``invalid_request``.

The event loop is asyncio's or uvloop's (``--http-loop``); either library missing
falls back to asyncio / h11 with a warning (:func:`uvicorn_config`).

The body deadline lives in :func:`mmgate.api.http.read_body`.
:class:`CloseUnreadBody` adds ``Connection: close`` to any response sent before
its request body was read to the end (413, 415, 408, 404 ...), so a slow body
cannot keep the connection once it has been answered.

:func:`uvicorn_config` is the one place that builds the server config; ``mmgate
serve`` and the tests' in-thread gateway both use it.  docs/limits.md lists the
defaults.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import ClassVar

import h11
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # needs httptools
    HAVE_HTTPTOOLS = True
except ImportError:  # pragma: no cover - optional: --http-parser falls back to h11
    HAVE_HTTPTOOLS = False

from mmgate.observe import metrics
from mmgate.errors import ErrorCode, GatewayError
from mmgate.config.settings import HttpSettings, Settings

log = logging.getLogger("mmgate.api.server")


def error_bytes(exc: GatewayError) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The error body and headers of ``exc`` for a response that closes the connection.

    Mirrors :func:`mmgate.api.http.error_response` (body, ``X-SMG-Error-Code``, ``Retry-After``
    for retryable codes) and counts the code in ``mmgate_errors_total``.
    """
    metrics.ERRORS.labels(exc.code.value).inc()
    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"x-smg-error-code", exc.code.value.encode()), (b"connection", b"close")]
    if exc.spec.retryable:
        headers.append((b"retry-after", b"1"))
    return body, headers


def raw_error_response(exc: GatewayError) -> bytes:
    """``exc`` as a complete HTTP/1.1 response, for writing straight to a transport."""
    body, headers = error_bytes(exc)
    reason = {400: "Bad Request", 408: "Request Timeout"}.get(exc.status, "Error")
    head = f"HTTP/1.1 {exc.status} {reason}\r\n".encode()
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers)
    return head + b"\r\n" + body


async def busy_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI app a connection opened past the cap gets: 503 ``server_busy``, then close."""
    body, headers = error_bytes(GatewayError(ErrorCode.SERVER_BUSY, "too many open connections; retry later"))
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


_last_busy_log = 0.0


def _log_busy(limit: int) -> None:
    """One warning per 10 s at most while connections are refused."""
    global _last_busy_log
    now = time.monotonic()
    if now - _last_busy_log >= 10.0:
        _last_busy_log = now
        log.warning("more than %d open connections: new ones get 503 server_busy", limit)


class _HeaderGuard:
    """The guards both HTTP protocols share (see the module docstring): a header deadline armed while a
    connection waits for a request's headers, and a connection cap answered by :func:`busy_app`.

    ``header_timeout_s`` and ``max_connections`` are class attributes; :func:`protocol_for` binds them to one
    :class:`HttpSettings` in a subclass, which is what ``uvicorn.Config(http=...)`` takes.  Mixed in before
    uvicorn's protocol class, whose ``cycle``, ``transport``, ``loop``, ``connections`` and ``app`` it reads.
    """

    header_timeout_s: ClassVar[float] = 10.0
    max_connections: ClassVar[int] = 1024

    _header_timer: asyncio.TimerHandle | None = None
    _armed_cycle: object = None  # the request cycle current when the deadline was armed
    _partial: bool = False  # a byte of the awaited request has arrived
    _header_bytes: int = 0  # bytes of the awaited request's line and headers (httptools' bound)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self.max_connections:  # type: ignore[attr-defined]
            self.app = busy_app
            _log_busy(self.max_connections)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to an unparsable request, as the error body ``invalid_request``."""
        self._cancel_header_timer()
        transport: asyncio.Transport = self.transport  # type: ignore[attr-defined]
        transport.write(raw_error_response(GatewayError(ErrorCode.INVALID_REQUEST, "invalid HTTP request")))
        transport.close()

    def _between_requests(self) -> bool:
        cycle = self.cycle  # type: ignore[attr-defined]
        return cycle is None or bool(cycle.response_complete)

    def _awaiting_request(self) -> bool:
        """Whether the parser is between requests (a timeout then answers 408 when a byte has arrived)."""
        return self._between_requests()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._armed_cycle = self.cycle  # type: ignore[attr-defined]
        self._partial = False
        self._header_bytes = 0
        loop: asyncio.AbstractEventLoop = self.loop  # type: ignore[attr-defined]
        self._header_timer = loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        transport: asyncio.Transport = self.transport  # type: ignore[attr-defined]
        if transport.is_closing() or self.cycle is not self._armed_cycle:  # type: ignore[attr-defined]
            return
        if self._partial and self._awaiting_request():
            exc = GatewayError(ErrorCode.REQUEST_TIMEOUT,
                               f"request headers not received within {self.header_timeout_s:g} s")
            transport.write(raw_error_response(exc))
        log.debug("closing a connection: no complete request headers within %g s", self.header_timeout_s)
        transport.close()


class GuardedH11Protocol(_HeaderGuard, H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (:class:`_HeaderGuard`)."""

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            if self._header_timer is None:
                self._arm_header_timer()
            self._partial = True
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # the headers are complete: a request began
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        before = self.cycle
        super().on_response_complete()
        if self.cycle is not before:  # a pipelined request began
            self._cancel_header_timer()
        elif self._between_requests() and self.conn.trailing_data[0] and not self.transport.is_closing():
            self._arm_header_timer()  # part of the next request is already buffered
            self._partial = True

    def _awaiting_request(self) -> bool:
        return bool(self.conn.our_state is h11.IDLE)


#: request line + headers past this many bytes get the 400 of an unparsable request (h11's default bound)
MAX_HEADER_BYTES = 16 * 1024


if HAVE_HTTPTOOLS:
    class GuardedHttpToolsProtocol(_HeaderGuard, HttpToolsProtocol):
        """uvicorn's httptools (llhttp) protocol with the same guards as :class:`GuardedH11Protocol`, and
        h11's 16 KiB bound on the request line + headers (llhttp has none).

        One difference from h11, where the parser's buffer is not visible: part of a next request that
        arrived in the same read as the end of the previous one is bounded by uvicorn's keep-alive timer
        (closed silently) rather than answered 408.
        """

        def data_received(self, data: bytes) -> None:
            waiting = self._between_requests()
            if waiting:
                if self._header_timer is None:
                    self._arm_header_timer()
                self._partial = True
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:  # the headers are complete: a request began
                self._cancel_header_timer()
                self._header_bytes = 0
            elif waiting and not self.transport.is_closing():
                # still no complete headers: every byte since the request's first one is request line or header
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES:
                    self.send_400_response("request line and headers too large")


def protocol_for(http: HttpSettings) -> type[asyncio.Protocol]:
    """The guarded protocol of ``http.parser`` (h11 when httptools is not installed), as a subclass bound
    to ``http``'s header timeout and connection cap."""
    base: type[asyncio.Protocol] = GuardedH11Protocol
    if http.parser == "httptools":
        if not HAVE_HTTPTOOLS:
            log.warning("--http-parser httptools: httptools is not installed; serving with h11")
        else:
            base = GuardedHttpToolsProtocol
    return type(f"Mmgate{base.__name__}", (base,),
                {"header_timeout_s": http.header_timeout_s, "max_connections": http.max_connections})


def loop_for(http: HttpSettings) -> str:
    """uvicorn's ``loop`` for ``http.loop``: ``uvloop`` when asked and installed, else ``asyncio``."""
    if http.loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            log.warning("--http-loop uvloop: uvloop is not installed; serving with asyncio's loop")
            return "asyncio"
        return "uvloop"
    return "asyncio"


class CloseUnreadBody:
    """ASGI middleware: ``Connection: close`` on a response that starts before the request body was
    read to its end (or on a request the app never read), so the client's remaining bytes are not
    waited for on a kept-alive connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0").strip()
        body_done = b"transfer-encoding" not in headers and length in (b"0", b"")

        async def tracked_receive() -> Message:
            nonlocal body_done
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_done:
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*kept, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, tracked_receive, closing_send)


def uvicorn_config(app: ASGIApp, settings: Settings, *, host: str | None = None, port: int | None = None,
                   log_level: str | None = None) -> uvicorn.Config:
    """The uvicorn config of a gateway: ``app`` wrapped in :class:`CloseUnreadBody`, served by
    :func:`protocol_for` ``(settings.http)`` on :func:`loop_for` ``(settings.http)`` (always explicit: uvicorn's
    ``auto`` would pick uvloop merely because it is installed); ``host``/``port``/``log_level`` default to
    ``settings``'."""
    return uvicorn.Config(CloseUnreadBody(app), host=host or settings.host, port=port or settings.port,
                          log_level=log_level or settings.log_level, http=protocol_for(settings.http),
                          loop=loop_for(settings.http), access_log=False)
