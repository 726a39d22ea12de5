"""Media intake: ``data:``, ``http://`` and ``https://`` URLs -> bytes.

Stage: fetch.  In: a URL string from a content part and the modality's byte
cap; out: the encoded bytes.  Nothing here decodes.

Policy (docs/media-intake.md):
* schemes: ``data``, ``http``, ``https`` only (else ``unsupported_media_url_scheme``);
* ``data:`` URLs take a fast path that never runs the payload through a URL
  parser: the header is read up to the first comma, base64 payloads are
  decoded with ``binascii`` after dropping ASCII whitespace (line-wrapped
  payloads), mapping the URL-safe alphabet and restoring missing padding;
  the declared media type is not trusted (the decoder sniffs the bytes);
* ``http(s)``: userinfo refused; the host must be on the allow-list when one
  is set; every address the host resolves to must be public unless
  ``allow_private_hosts`` (loopback, private, link-local, CGNAT, unspecified,
  multicast, reserved and metadata addresses, also IPv4-mapped IPv6) — checked
  before the first request and again on every redirect hop, redirects capped;
  connect/read/total timeouts; the body is streamed and cut at the byte cap.
* status discipline: caller's mistakes 400/413, transient faults (timeout,
  refused connection, origin 5xx) retryable 503.  Messages name the host at
  most, never the payload.
"""

from __future__ import annotations

import asyncio
import binascii
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import unquote_to_bytes, urljoin, urlsplit

import httpx

from mmgate.errors import ErrorCode, GatewayError
from mmgate.settings import FetchSettings

_B64_URLSAFE = bytes.maketrans(b"-_", b"+/")
_WHITESPACE = b" \t\r\n\f\v"
ALLOWED_SCHEMES = ("data", "http", "https")

Resolver = Callable[[str, int], Awaitable[list[str]]]


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
                           f"media URL scheme {scheme!r} is not supported (use http, https or data)", param)
    return scheme


def decode_data_url(url: str, max_bytes: int, param: str | None = None) -> bytes:
    """Payload bytes of a ``data:`` URL.

    Raises:
        GatewayError(INVALID_MEDIA_URL): no comma, or a payload that is not base64.
        GatewayError(MEDIA_TOO_LARGE): the decoded payload would exceed ``max_bytes``.
    """
    comma = url.find(",", 5)
    if comma < 0:
        raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "data URL has no comma", param)
    header = url[5:comma]
    params = [p.strip().lower() for p in header.split(";")]
    payload = url[comma + 1:]
    if "base64" in params[1:]:
        if (len(payload) // 4) * 3 > max_bytes + 3:
            raise GatewayError(ErrorCode.MEDIA_TOO_LARGE, f"data URL payload exceeds {max_bytes} bytes", param)
        try:
            raw = payload.encode("ascii")
        except UnicodeEncodeError:
            raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "data URL payload is not base64", param) from None
        if any(c in raw for c in _WHITESPACE):
            raw = raw.translate(None, _WHITESPACE)
        if b"%" in raw:
            raw = unquote_to_bytes(raw)
        raw = raw.translate(_B64_URLSAFE).rstrip(b"=")
        raw += b"=" * (-len(raw) % 4)
        try:
            data = binascii.a2b_base64(raw, strict_mode=True)
        except (binascii.Error, ValueError):
            raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "data URL payload is not valid base64", param) from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise GatewayError(ErrorCode.MEDIA_TOO_LARGE, f"data URL payload exceeds {max_bytes} bytes", param)
    if not data:
        raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "data URL payload is empty", param)
    return data


def is_public_address(address: str) -> bool:
    """False for loopback, private, link-local, CGNAT, unspecified, multicast, reserved, site-local
    and cloud-metadata addresses, including their IPv4-mapped / 6to4 IPv6 forms."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        for embedded in (ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None):
            if embedded is not None and not is_public_address(str(embedded)):
                return False
        if ip in ipaddress.ip_network("64:ff9b::/96"):  # NAT64 of an IPv4 address
            return is_public_address(str(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)))
    if ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip.is_reserved:
        return False
    if isinstance(ip, ipaddress.IPv4Address) and ip in ipaddress.ip_network("100.64.0.0/10"):
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return False
    return bool(ip.is_global)


async def system_resolver(host: str, port: int) -> list[str]:
    """All addresses ``host`` resolves to (numeric hosts in any form resolve to themselves)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class MediaFetcher:
    """Fetches media bytes under one :class:`FetchSettings` policy.

    Args:
        settings: limits and policy.
        resolver: async ``(host, port) -> [address]``; tests replace it.
        transport: an ``httpx.AsyncBaseTransport``; tests may replace it with
            one that fails the test if called.
    """

    def __init__(self, settings: FetchSettings, resolver: Resolver | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.settings = settings
        self._resolver = resolver or system_resolver
        timeout = httpx.Timeout(settings.read_timeout_s, connect=settings.connect_timeout_s)
        self._client = httpx.AsyncClient(timeout=timeout, follow_redirects=False, transport=transport,
                                         trust_env=False, headers={"user-agent": "mmgate"})

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
        try:
            return await asyncio.wait_for(self._fetch_http(url, max_bytes, param), self.settings.total_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            raise GatewayError(ErrorCode.MEDIA_FETCH_TIMEOUT, "media fetch timed out", param) from None

    async def _check_target(self, url: str, param: str | None) -> None:
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https"):
            raise GatewayError(ErrorCode.UNSUPPORTED_MEDIA_URL_SCHEME, "redirect to a non-http scheme", param)
        if parts.username is not None or parts.password is not None or "@" in parts.netloc:
            raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "media URLs with userinfo are not allowed", param)
        host = (parts.hostname or "").rstrip(".").lower()
        if not host:
            raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "media URL has no host", param)
        allowed = self.settings.allowed_domains
        if allowed and not any(host == d or host.endswith("." + d) for d in allowed):
            raise GatewayError(ErrorCode.MEDIA_HOST_NOT_ALLOWED, "media host is not on the allow-list", param)
        if self.settings.allow_private_hosts:
            return
        try:
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        except ValueError:
            raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "media URL has an invalid port", param) from None
        try:
            addresses = await self._resolver(host, port)
        except (OSError, UnicodeError):
            raise GatewayError(ErrorCode.MEDIA_FETCH_FAILED, "media host does not resolve", param) from None
        if not addresses or not all(is_public_address(a) for a in addresses):
            raise GatewayError(ErrorCode.MEDIA_HOST_NOT_ALLOWED,
                               "media host resolves to a private, loopback or link-local address", param)

    async def _fetch_http(self, url: str, max_bytes: int, param: str | None) -> bytes:
        for _hop in range(self.settings.max_redirects + 1):
            await self._check_target(url, param)
            try:
                async with self._client.stream("GET", url) as resp:
                    if resp.is_redirect:
                        location = resp.headers.get("location")
                        if not location:
                            raise GatewayError(ErrorCode.MEDIA_FETCH_FAILED, "redirect without a location", param)
                        url = urljoin(url, location)
                        continue
                    if resp.status_code >= 500:
                        raise GatewayError(ErrorCode.MEDIA_FETCH_UNAVAILABLE, f"media origin answered {resp.status_code}", param)
                    if resp.status_code >= 400:
                        raise GatewayError(ErrorCode.MEDIA_FETCH_FAILED, f"media origin answered {resp.status_code}", param)
                    declared = resp.headers.get("content-length")
                    if declared and declared.isdigit() and int(declared) > max_bytes:
                        raise GatewayError(ErrorCode.MEDIA_TOO_LARGE, f"media exceeds {max_bytes} bytes", param)
                    chunks = bytearray()
                    async for chunk in resp.aiter_bytes():
                        chunks += chunk
                        if len(chunks) > max_bytes:
                            raise GatewayError(ErrorCode.MEDIA_TOO_LARGE, f"media exceeds {max_bytes} bytes", param)
                    if not chunks:
                        raise GatewayError(ErrorCode.MEDIA_DECODE_FAILED, "media body is empty", param)
                    return bytes(chunks)
            except httpx.TimeoutException:
                raise GatewayError(ErrorCode.MEDIA_FETCH_TIMEOUT, "media fetch timed out", param) from None
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                raise GatewayError(ErrorCode.MEDIA_FETCH_UNAVAILABLE, "media origin could not be reached", param) from None
            except httpx.InvalidURL:
                raise GatewayError(ErrorCode.INVALID_MEDIA_URL, "media URL is invalid", param) from None
            except httpx.HTTPError:
                raise GatewayError(ErrorCode.MEDIA_FETCH_UNAVAILABLE, "media fetch failed", param) from None
        raise GatewayError(ErrorCode.MEDIA_FETCH_FAILED, f"more than {self.settings.max_redirects} redirects", param)
