"""Media intake: ``data:``, ``http://`` and ``https://`` URLs -> bytes.

Stage: fetch.  In: a URL string from a content part and the modality's byte
cap; out: the encoded bytes.  Nothing here decodes.

Policy (docs/media-intake.md has the full table):
* schemes: ``data``, ``http``, ``https`` only (else ``unsupported_media_url_scheme``);
* ``data:`` URLs: :mod:`mmgate.media.data_url`;
* ``http(s)``: the URL is parsed once, by httpx, and that parse is what is
  checked and what is requested (no parser differential).  Userinfo is
  refused; the host must be on the allow-list when one is set; a numeric host
  in any spelling (``2130706433``, ``0x7f000001``, ``0177.0.0.1``,
  ``[::ffff:127.0.0.1]``) is read by :func:`~mmgate.media.addresses.numeric_host`,
  a name is resolved once; unless ``allow_private_hosts``, every address
  must be public (no loopback, private, link-local, CGNAT, unspecified or
  metadata address).  The connection then goes to exactly those addresses
  (:mod:`mmgate.media.connect`: no second lookup, so no DNS rebinding), with
  the name kept for ``Host``, SNI and certificate checks.  Every redirect hop
  is checked the same way; hops are capped.  Connect, read and total
  timeouts; the body is streamed and cut at the byte cap.
* status discipline: the caller's mistakes are 400/413 (bad URL, disallowed
  host, unresolvable name, origin 4xx, too many redirects, oversized body,
  a TLS certificate not valid for the name);
  transient faults are retryable 503 (timeouts, refused or reset
  connections, a temporary DNS failure, origin 5xx/408/429).  Messages name
  the host at most, never the payload.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

import httpcore
import httpx

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.addresses import (
    Resolver,
    is_public_address,
    numeric_host,
    system_resolver,
)
from mmgate.media.connect import PIN_EXTENSION, Pin, PinnedTransport
from mmgate.media.data_url import decode_data_url
from mmgate.config.settings import FetchSettings

__all__ = ["ALLOWED_SCHEMES", "MediaFetcher", "Resolver", "check_scheme", "decode_data_url", "is_public_address",
           "system_resolver", "url_scheme"]

ALLOWED_SCHEMES = ("data", "http", "https")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_TRANSIENT_STATUSES = {408, 429}


def url_scheme(url: str) -> str:
    """Lower-case scheme of ``url`` ('' when there is none)."""
    head, sep, _ = url[:16].partition(":")
    return head.lower() if sep and head.isascii() and head.replace("+", "").replace("-", "").replace(".", "").isalnum() else ""


def check_scheme(url: str, param: str | None = None) -> str:
    """Refuse anything but data/http/https before any work is done.

    Raises:
        GatewayError(UNSUPPORTED_MEDIA_URL_SCHEME | INVALID_MEDIA_URL)
    """
    if not isinstance(url, str) or not url:
        raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "media URL is empty", param)
    scheme = url_scheme(url)
    if not scheme:
        raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "media URL has no scheme", param)
    if scheme not in ALLOWED_SCHEMES:
        raise GatewayError(ErrorCode.UNSUPPORTED_MEDIA_URL_SCHEME,
                           "media URL scheme is not supported (use http, https or data)", param)
    return scheme


def parse_http_url(url: str | httpx.URL, param: str | None = None) -> httpx.URL:
    """The httpx parse of an http(s) media URL, refused when it has userinfo or no usable host/port.

    Raises:
        GatewayError(UNSUPPORTED_MEDIA_URL_SCHEME | INVALID_MEDIA_URL)
    """
    try:
        parsed = url if isinstance(url, httpx.URL) else httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "media URL is invalid", param) from None
    if parsed.scheme not in _DEFAULT_PORTS:
        raise GatewayError(ErrorCode.UNSUPPORTED_MEDIA_URL_SCHEME, "media URL must use http or https", param)
    if parsed.userinfo:
        raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "media URLs with userinfo are not allowed", param)
    host = parsed.raw_host.decode("ascii")
    if not host.strip(".") or "%" in host:
        raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "media URL has no usable host", param)
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "media URL has an invalid port", param)
    return parsed


def _tls_verification_failed(exc: BaseException) -> bool:
    """Whether a connect error was a certificate verification failure (the caller's URL, not a transient fault)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class MediaFetcher:
    """Fetches media bytes under one :class:`FetchSettings` policy.

    Args:
        settings: limits and policy.
        resolver: async ``(host, port) -> [address]``; tests replace it.
        transport: an ``httpx.AsyncBaseTransport``; tests may replace it with one
            that fails the test if called.  Default: :class:`PinnedTransport`.
        network_backend: the socket layer under the default transport (an
            ``httpcore.AsyncNetworkBackend`` that receives IP literals only);
            tests replace it.
        ssl_context: TLS settings of the default transport (tests trust their own CA).
    """

    def __init__(self, settings: FetchSettings, resolver: Resolver | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 network_backend: httpcore.AsyncNetworkBackend | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.settings = settings
        self._resolver = resolver or system_resolver
        self._allowed = tuple(d.strip(".").lower() for d in settings.allowed_domains if d.strip("."))
        timeout = httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s)
        self._client = httpx.AsyncClient(
            timeout=timeout, follow_redirects=False, trust_env=False,
            transport=transport or PinnedTransport(network_backend=network_backend, ssl_context=ssl_context),
            headers={"user-agent": "mmgate", "accept-encoding": "identity"},
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def fetch(self, url: str, max_bytes: int, param: str | None = None) -> bytes:
        """Bytes behind ``url`` (data or http/https), at most ``max_bytes``.

        Raises:
            GatewayError: see the module docstring for codes.
        """
        scheme = check_scheme(url, param)
        if scheme == "data":
            return decode_data_url(url, max_bytes, param)
        target = parse_http_url(url, param)
        try:
            return await asyncio.wait_for(self._fetch_http(target, max_bytes, param), self.settings.total_timeout_s)
        except TimeoutError:
            raise GatewayError(ErrorCode.MEDIA_FETCH_TIMEOUT, "media fetch timed out", param) from None

    def _host_allowed(self, host: str) -> bool:
        return not self._allowed or any(host == d or host.endswith("." + d) for d in self._allowed)

    async def vet(self, url: httpx.URL, param: str | None = None) -> Pin:
        """Where a request for ``url`` may connect, after the allow-list and address policy.

        Raises:
            GatewayError(MEDIA_HOST_NOT_ALLOWED): not on the allow-list, or a non-public address.
            GatewayError(MEDIA_FETCH_FAILED): the name does not resolve.
            GatewayError(MEDIA_FETCH_UNAVAILABLE): the resolver failed temporarily.
        """
        host = url.raw_host.decode("ascii")
        name = host.rstrip(".")
        if not self._host_allowed(name):
            raise GatewayError(ErrorCode.MEDIA_HOST_NOT_ALLOWED, "media host is not on the allow-list", param)
        port = url.port or _DEFAULT_PORTS[url.scheme]
        literal = numeric_host(name)
        if literal is not None:
            addresses = [str(literal)]
        else:
            addresses = await self._resolve(name, port, param)
        if not self.settings.allow_private_hosts and not all(is_public_address(a) for a in addresses):
            raise GatewayError(ErrorCode.MEDIA_HOST_NOT_ALLOWED,
                               "media host is or resolves to a private, loopback, link-local or metadata address",
                               param)
        return Pin(host=host, port=port, addresses=tuple(addresses))

    async def _resolve(self, name: str, port: int, param: str | None) -> list[str]:
        try:
            addresses = [str(a) for a in await self._resolver(name, port)]
        except socket.gaierror as exc:
            if exc.errno == socket.EAI_AGAIN:
                raise GatewayError(ErrorCode.MEDIA_FETCH_UNAVAILABLE, "media host name lookup failed temporarily",
                                   param) from None
            raise GatewayError(ErrorCode.MEDIA_FETCH_FAILED, "media host does not resolve", param) from None
        except (OSError, UnicodeError, ValueError):
            raise GatewayError(ErrorCode.MEDIA_FETCH_FAILED, "media host does not resolve", param) from None
        if not addresses:
            raise GatewayError(ErrorCode.MEDIA_FETCH_FAILED, "media host does not resolve", param)
        return addresses

    async def _fetch_http(self, url: httpx.URL, max_bytes: int, param: str | None) -> bytes:
        for _hop in range(self.settings.max_redirects + 1):
            pin = await self.vet(url, param)
            try:
                async with self._client.stream("GET", url, extensions={PIN_EXTENSION: pin}) as resp:
                    if resp.has_redirect_location:  # 301/302/303/307/308 with a Location; other 3xx: 400
                        url = self._redirect_target(url, resp.headers["location"], param)
                        continue
                    self._check_status(resp.status_code, param)
                    return await self._read_body(resp, max_bytes, param)
            except httpx.TimeoutException:
                raise GatewayError(ErrorCode.MEDIA_FETCH_TIMEOUT, "media fetch timed out", param) from None
            except httpx.InvalidURL:
                raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "media URL is invalid", param) from None
            except (httpx.HTTPError, httpx.StreamError) as exc:
                if _tls_verification_failed(exc):
                    raise GatewayError(ErrorCode.MEDIA_FETCH_FAILED, "media origin's TLS certificate is not valid for "
                                       "its name", param) from None
                raise GatewayError(ErrorCode.MEDIA_FETCH_UNAVAILABLE, "media origin could not be reached", param) from None
        raise GatewayError(ErrorCode.MEDIA_FETCH_FAILED, f"more than {self.settings.max_redirects} redirects", param)

    @staticmethod
    def _redirect_target(url: httpx.URL, location: str, param: str | None) -> httpx.URL:
        try:
            target = url.join(location)
        except (httpx.InvalidURL, ValueError, TypeError):
            raise GatewayError(ErrorCode.MEDIA_FETCH_FAILED, "media origin redirected to an invalid URL", param) from None
        if target.scheme not in _DEFAULT_PORTS:
            raise GatewayError(ErrorCode.UNSUPPORTED_MEDIA_URL_SCHEME, "media origin redirected to a non-http URL", param)
        return parse_http_url(target, param)

    @staticmethod
    def _check_status(status: int, param: str | None) -> None:
        if 200 <= status < 300:
            return
        if status >= 500 or status in _TRANSIENT_STATUSES:
            raise GatewayError(ErrorCode.MEDIA_FETCH_UNAVAILABLE, f"media origin answered {status}", param)
        raise GatewayError(ErrorCode.MEDIA_FETCH_FAILED, f"media origin answered {status}", param)

    @staticmethod
    async def _read_body(resp: httpx.Response, max_bytes: int, param: str | None) -> bytes:
        declared = resp.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise GatewayError(ErrorCode.MEDIA_TOO_LARGE, f"media exceeds {max_bytes} bytes", param)
        body = bytearray()
        async for chunk in resp.aiter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise GatewayError(ErrorCode.MEDIA_TOO_LARGE, f"media exceeds {max_bytes} bytes", param)
        if not body:
            raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "media body is empty", param)
        return bytes(body)
