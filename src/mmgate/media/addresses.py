"""Which network addresses a media fetch may connect to.

Stage: fetch (policy).  In: the host of an ``http(s)`` media URL as httpx
encodes it; out: the IP addresses it stands for, and whether each is public.

* :func:`numeric_host` reads every numeric spelling a C resolver accepts
  (``inet_aton``: ``127.0.0.1``, ``127.1``, ``2130706433``, ``0x7f000001``,
  ``0177.0.0.1``, mixed ``0x7f.0.0.01``; IPv6 literals such as
  ``::ffff:127.0.0.1``), so a numeric host is judged without asking DNS and
  without depending on what an injected resolver does with it;
* :func:`is_public_address` is False for loopback, private, link-local,
  carrier-grade NAT, unspecified, multicast, reserved, site-local and
  cloud-metadata addresses, including IPv4 addresses embedded in IPv6
  (IPv4-mapped, IPv4-compatible, 6to4, Teredo, NAT64);
* :func:`system_resolver` asks the system resolver for every address of a name.

Invariant: a media fetch connects only to addresses this module was asked
about (``mmgate.media.connect`` pins the connection to them).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: async ``(host, port) -> [address, ...]``; tests replace the system resolver with their own.
Resolver = Callable[[str, int], Awaitable[list[str]]]

# Networks refused beside what ``ipaddress`` already classifies as non-global.
_CGNAT = ipaddress.ip_network("100.64.0.0/10")  # RFC 6598 shared address space (carrier-grade NAT)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052 well-known NAT64 prefix
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215 local-use NAT64 prefix
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated ::a.b.c.d
_METADATA = frozenset({
    ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, OpenStack, ... (link-local anyway)
    ipaddress.ip_address("169.254.170.2"),  # AWS ECS task metadata
    ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud (inside CGNAT anyway)
    ipaddress.ip_address("fd00:ec2::254"),  # AWS IMDS over IPv6 (unique-local anyway)
})


def _inet_aton_part(text: str) -> int | None:
    """One dotted part as ``inet_aton`` reads it: ``0x`` hex, leading-``0`` octal, else decimal."""
    if not text:
        return None
    if text[:2] in ("0x", "0X"):
        digits, base = text[2:], 16
        if not digits:  # "0x" alone is 0 for glibc
            return 0
    elif len(text) > 1 and text[0] == "0":
        digits, base = text[1:], 8
    else:
        digits, base = text, 10
    try:
        return int(digits, base) if digits.isascii() and digits.isalnum() else None
    except ValueError:
        return None


def _numeric_ipv4(host: str) -> ipaddress.IPv4Address | None:
    parts = host.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values = [_inet_aton_part(p) for p in parts]
    if any(v is None for v in values):
        return None
    nums = [v for v in values if v is not None]
    *head, last = nums
    if any(v > 0xFF for v in head) or last >= 1 << (8 * (5 - len(nums))):
        return None
    value = 0
    for v in head:
        value = value << 8 | v
    value = value << (8 * (4 - len(head))) | last
    return ipaddress.IPv4Address(value)


def numeric_host(host: str) -> IPAddress | None:
    """The address a numeric host spells, or None for a DNS name.

    ``host`` is the URL host without brackets and without a trailing dot.

    Examples: ``numeric_host("2130706433")`` -> ``IPv4Address('127.0.0.1')``;
    ``numeric_host("0x7f.1")`` -> ``IPv4Address('127.0.0.1')``;
    ``numeric_host("::ffff:7f00:1")`` -> ``IPv6Address('::ffff:7f00:1')``;
    ``numeric_host("example.com")`` -> ``None``.
    """
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host)
        except ValueError:
            return None
    return _numeric_ipv4(host)


def is_public_address(address: str | IPAddress) -> bool:
    """True only for a globally routable unicast address that is no metadata endpoint.

    An address that does not parse is not public.
    """
    try:
        ip = address if not isinstance(address, str) else ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        embedded: list[ipaddress.IPv4Address] = []
        if ip.ipv4_mapped is not None:
            embedded.append(ip.ipv4_mapped)
        if ip.sixtofour is not None:
            embedded.append(ip.sixtofour)
        if ip.teredo is not None:
            embedded.extend(ip.teredo)
        if ip in _NAT64 or ip in _NAT64_LOCAL or (ip in _IPV4_COMPATIBLE and int(ip) > 1):
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip in _NAT64_LOCAL or any(not is_public_address(e) for e in embedded):
            return False
        if ip.is_site_local:
            return False
    if ip in _METADATA:
        return False
    if ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip.is_reserved:
        return False
    if isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT:
        return False
    return bool(ip.is_global)


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, in the resolver's order (duplicates dropped).

    Raises:
        socket.gaierror: the name does not resolve (``EAI_AGAIN``: not right now).
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))
