"""The connection layer of media fetches: connect only to the addresses that were vetted.

Stage: fetch (transport).  In: an ``httpx.Request`` carrying a :class:`Pin`
(the URL's host and port and the addresses the fetch policy approved, in the
request extension :data:`PIN_EXTENSION`); out: the response, read over a TCP
connection to one of those addresses.

Why: checking what a name resolves to and then letting the HTTP client
resolve it again leaves a DNS-rebinding gap (the second answer can be
``127.0.0.1``).  Here the name is never resolved again: the network backend
receives the pinned IP literal, while the URL keeps the name, so the
``Host`` header, TLS SNI and certificate verification still use the name
(httpcore ``AsyncHTTPConnection._connect`` passes the origin host as
``server_hostname`` to ``start_tls``).

Invariant: a connection attempt whose host and port are not those of the
request's pin is refused (fail closed), and no name lookup happens below this
layer.  Pooled keep-alive connections are reused only for the same origin,
so they too lead to an address that was vetted for that host.

httpx does not let a client pick httpcore's network backend, so
:class:`PinnedTransport` is a small ``httpx.AsyncBaseTransport`` over
``httpcore.AsyncConnectionPool`` (the shape of httpx 0.28
``AsyncHTTPTransport.handle_async_request``, with its exception mapping).
"""

from __future__ import annotations

import contextlib
import functools
import ssl
import typing
from collections.abc import AsyncIterator, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import httpcore
import httpx

#: ``httpx.Request.extensions`` key of the :class:`Pin` of a request.
PIN_EXTENSION = "mmgate.pin"


@dataclass(frozen=True, slots=True)
class Pin:
    """Where one request may connect."""

    host: str  # the URL host exactly as httpx encodes it (IDNA, no brackets): what httpcore hands the backend
    port: int
    addresses: tuple[str, ...]  # vetted IP literals, tried in this order


_CURRENT_PIN: ContextVar[Pin | None] = ContextVar("mmgate_media_pin", default=None)


class PinnedNetworkBackend(httpcore.AsyncNetworkBackend):
    """Connects ``(host, port)`` to the pinned addresses of the current request, never by name.

    Args:
        inner: the backend that opens sockets to IP literals (httpcore's anyio
            backend by default); tests replace it.
    """

    def __init__(self, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.AsyncNetworkStream:
        pin = _CURRENT_PIN.get()
        if pin is None or pin.host != host or pin.port != port or not pin.addresses:
            raise httpcore.ConnectError("connection refused by mmgate: target was not vetted")
        error: Exception | None = None
        for address in pin.addresses:
            try:
                return await self._inner.connect_tcp(address, port, timeout=timeout, local_address=local_address,
                                                     socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("connection refused by mmgate: unix sockets are not media origins")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


# httpcore exception -> httpx exception, most specific first (httpx 0.28 ``map_httpcore_exceptions``).
_EXCEPTIONS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.ProtocolError, httpx.ProtocolError),
)


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        for core_type, httpx_type in _EXCEPTIONS:
            if isinstance(exc, core_type):
                raise httpx_type(str(exc)) from exc
        raise


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, stream: typing.AsyncIterable[bytes]) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        close = getattr(self._stream, "aclose", None)
        if close is not None:
            await close()


@functools.lru_cache(maxsize=1)
def default_ssl_context() -> ssl.SSLContext:
    """certifi roots, hostname verification on; built once per process (loading the roots is slow)."""
    return httpx.create_ssl_context(trust_env=False)


class PinnedTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 transport whose connections go to the request's :class:`Pin` only.

    Args:
        network_backend: opens sockets to IP literals (tests replace it); it is
            wrapped in :class:`PinnedNetworkBackend`.
        ssl_context: for https origins; default: certifi roots, hostname checks on.
        max_connections, max_keepalive_connections, keepalive_expiry_s: pool limits.
    """

    def __init__(self, network_backend: httpcore.AsyncNetworkBackend | None = None,
                 ssl_context: ssl.SSLContext | None = None, max_connections: int = 100,
                 max_keepalive_connections: int = 20, keepalive_expiry_s: float = 5.0) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context or default_ssl_context(),
            max_connections=max_connections, max_keepalive_connections=max_keepalive_connections,
            keepalive_expiry=keepalive_expiry_s, http1=True, http2=False,
            network_backend=PinnedNetworkBackend(network_backend),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        pin = request.extensions.get(PIN_EXTENSION)
        extensions = {k: v for k, v in request.extensions.items() if k != PIN_EXTENSION}
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host, port=request.url.port,
                             target=request.url.raw_path),
            headers=request.headers.raw, content=request.stream, extensions=extensions,
        )
        token = _CURRENT_PIN.set(pin if isinstance(pin, Pin) else None)
        try:
            with _httpx_errors():
                resp = await self._pool.handle_async_request(core_request)
        finally:
            _CURRENT_PIN.reset(token)
        assert isinstance(resp.stream, typing.AsyncIterable)
        return httpx.Response(status_code=resp.status, headers=resp.headers, stream=_ResponseStream(resp.stream),
                              extensions=resp.extensions)

    async def aclose(self) -> None:
        await self._pool.aclose()
