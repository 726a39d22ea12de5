"""The fetch policy: SSRF refusals with no connection made, DNS pinning, redirects, timeouts, caps.

Network rule: every socket these tests open is on 127.0.0.0/8 (or ``::1``).
Private, link-local, CGNAT and metadata addresses are only ever handed to a
connection layer that records the attempt and fails (``FailIfCalled*``), and
"public" hosts are fake names whose pinned address the test backend routes to
a loopback port.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.connect import PIN_EXTENSION, Pin, PinnedTransport
from mmgate.media.fetch import MediaFetcher
from mmgate.config.settings import FetchSettings
from tests.media.hostile_urls import LOOPBACK_HOSTS, NON_PUBLIC_URLS, PUBLIC
from tests.media.netfakes import (
    FailIfCalledBackend,
    FailIfCalledTransport,
    FakeResolver,
    LoopbackOnlyBackend,
    SequenceResolver,
    loopback_listener,
)
from tests.media.origin import Behavior, ScriptedOrigin, scripted_origin

BODY = b"\x89PNG-test-body" * 10


def run(coro):
    return asyncio.run(coro)


async def fetch_once(fetcher: MediaFetcher, url: str, max_bytes: int = 1 << 20) -> bytes:
    try:
        return await fetcher.fetch(url, max_bytes, "messages[0].content[0]")
    finally:
        await fetcher.aclose()


def refusal(fetcher: MediaFetcher, url: str, max_bytes: int = 1 << 20) -> GatewayError:
    with pytest.raises(GatewayError) as err:
        run(fetch_once(fetcher, url, max_bytes))
    return err.value


@pytest.fixture
def origin() -> Iterator[ScriptedOrigin]:
    with scripted_origin() as o:
        yield o


# --- loopback in every spelling: refused by default, and the listener sees no connection ----------------------



@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
def test_loopback_in_any_spelling_is_refused_before_any_connection(host: str) -> None:
    with loopback_listener() as listener:
        fetcher = MediaFetcher(FetchSettings())  # default policy, real resolver, real connection layer
        err = refusal(fetcher, f"http://{host}:{listener.port}/x.png")
        assert err.code in (ErrorCode.MEDIA_HOST_NOT_ALLOWED, ErrorCode.INVALID_MEDIA_URL), err
        assert err.status == 400
        assert listener.settled() == 0


def test_ipv6_loopback_listener_sees_no_connection() -> None:
    try:
        ctx = loopback_listener("::1")
        listener = ctx.__enter__()
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    try:
        err = refusal(MediaFetcher(FetchSettings()), f"http://[::1]:{listener.port}/x.png")
        assert err.code is ErrorCode.MEDIA_HOST_NOT_ALLOWED
        assert listener.settled() == 0
    finally:
        ctx.__exit__(None, None, None)


# --- private, link-local, CGNAT, metadata: no connection layer is ever called ---------------------------------



@pytest.mark.parametrize("url,table", NON_PUBLIC_URLS)
def test_non_public_target_is_refused_and_the_transport_is_never_called(url: str, table: dict) -> None:
    transport = FailIfCalledTransport()
    err = refusal(MediaFetcher(FetchSettings(), resolver=FakeResolver(table), transport=transport), url)
    assert err.code is ErrorCode.MEDIA_HOST_NOT_ALLOWED and err.status == 400
    assert transport.calls == []


@pytest.mark.parametrize("url,table", NON_PUBLIC_URLS)
def test_non_public_target_is_refused_and_no_socket_is_ever_opened(url: str, table: dict) -> None:
    backend = FailIfCalledBackend()
    err = refusal(MediaFetcher(FetchSettings(), resolver=FakeResolver(table), network_backend=backend), url)
    assert err.code is ErrorCode.MEDIA_HOST_NOT_ALLOWED
    assert backend.calls == []


@pytest.mark.parametrize("url", [
    "http://allowed.example@127.0.0.1/x.png",
    "http://user:secret@cdn.test/x.png",
    "http://cdn.test\\@127.0.0.1/x.png",
    "http://%40@cdn.test/x.png",
    "https://:@cdn.test/x.png",
])
def test_userinfo_is_refused_before_any_lookup(url: str) -> None:
    resolver, transport = FakeResolver({"cdn.test": [PUBLIC]}), FailIfCalledTransport()
    err = refusal(MediaFetcher(FetchSettings(allow_private_hosts=True), resolver=resolver, transport=transport), url)
    assert err.code is ErrorCode.INVALID_MEDIA_URL
    assert "secret" not in err.message
    assert resolver.calls == [] and transport.calls == []


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/x", "http://[fe80::1%25eth0]/x", "http:///x", "http://:80/x"])
def test_unusable_host_or_port_is_invalid_media_url(url: str) -> None:
    transport = FailIfCalledTransport()
    err = refusal(MediaFetcher(FetchSettings(allow_private_hosts=True), transport=transport), url)
    assert err.code is ErrorCode.INVALID_MEDIA_URL and transport.calls == []


# --- allow-list --------------------------------------------------------------------------------------------------

def test_allow_list_admits_the_domain_and_its_subdomains_only(origin: ScriptedOrigin) -> None:
    origin.add("/a.png", Behavior(body=BODY))
    table = {"media.test": [PUBLIC], "cdn.media.test": [PUBLIC], "evilmedia.test": [PUBLIC],
             "media.test.evil.test": [PUBLIC]}
    settings = FetchSettings(allowed_domains=("Media.Test",))
    for host in ("media.test", "cdn.media.test", "CDN.Media.Test."):
        backend = LoopbackOnlyBackend({(PUBLIC, 80): origin.port})
        assert run(fetch_once(MediaFetcher(settings, resolver=FakeResolver(table), network_backend=backend),
                              f"http://{host}/a.png")) == BODY
    for host in ("evilmedia.test", "media.test.evil.test", "127.0.0.1"):
        resolver, backend = FakeResolver(table), FailIfCalledBackend()
        err = refusal(MediaFetcher(settings, resolver=resolver, network_backend=backend), f"http://{host}/a.png")
        assert err.code is ErrorCode.MEDIA_HOST_NOT_ALLOWED
        assert resolver.calls == [] and backend.calls == []


# --- DNS pinning (no rebinding) and TLS names ----------------------------------------------------------------------

def test_connection_goes_to_the_vetted_address_and_the_name_is_not_resolved_again(origin: ScriptedOrigin) -> None:
    """A rebinding name answers a public address, then 127.0.0.1: only the first answer is ever used."""
    origin.add("/img.png", Behavior(body=BODY))
    resolver = SequenceResolver([[PUBLIC], ["127.0.0.1"]])
    backend = LoopbackOnlyBackend({(PUBLIC, 80): origin.port})
    fetcher = MediaFetcher(FetchSettings(), resolver=resolver, network_backend=backend)
    assert run(fetch_once(fetcher, "http://rebind.test/img.png")) == BODY
    assert resolver.calls == ["rebind.test"]  # one lookup, checked
    assert backend.calls == [(PUBLIC, 80)]  # the socket layer got the checked IP literal, never the name
    assert backend.refused == []
    assert origin.host_headers == ["rebind.test"]  # the origin still sees the name


def test_second_fetch_of_a_rebinding_name_is_refused_without_a_connection(origin: ScriptedOrigin) -> None:
    origin.add("/img.png", Behavior(body=BODY))
    resolver = SequenceResolver([[PUBLIC], ["127.0.0.1"]])
    backend = LoopbackOnlyBackend({(PUBLIC, 80): origin.port})

    async def twice() -> GatewayError:
        fetcher = MediaFetcher(FetchSettings(), resolver=resolver, network_backend=backend)
        try:
            assert await fetcher.fetch("http://rebind.test/img.png", 1 << 20) == BODY
            with pytest.raises(GatewayError) as err:
                await fetcher.fetch("http://rebind.test/img.png", 1 << 20)
            return err.value
        finally:
            await fetcher.aclose()

    assert run(twice()).code is ErrorCode.MEDIA_HOST_NOT_ALLOWED
    assert backend.calls == [(PUBLIC, 80)] and origin.hits["/img.png"] == 1


def test_pinned_transport_refuses_a_request_without_a_matching_pin() -> None:
    backend = FailIfCalledBackend()

    async def go(extensions: dict) -> None:
        async with httpx.AsyncClient(transport=PinnedTransport(network_backend=backend)) as client:
            await client.get("http://cdn.test/x", extensions=extensions)

    for extensions in ({}, {PIN_EXTENSION: Pin(host="other.test", port=80, addresses=(PUBLIC,))},
                       {PIN_EXTENSION: Pin(host="cdn.test", port=8080, addresses=(PUBLIC,))}):
        with pytest.raises(httpx.ConnectError):
            run(go(extensions))
    assert backend.calls == []


# --- redirects ---------------------------------------------------------------------------------------------------

def _public_fetcher(origin: ScriptedOrigin, **settings: object) -> tuple[MediaFetcher, LoopbackOnlyBackend]:
    backend = LoopbackOnlyBackend({(PUBLIC, 80): origin.port})
    table = {"cdn.test": [PUBLIC], "metadata.test": ["169.254.169.254"], "localhost": ["127.0.0.1", "::1"]}
    return MediaFetcher(FetchSettings(**settings), resolver=FakeResolver(table), network_backend=backend), backend


def test_redirect_to_loopback_is_refused_on_the_second_hop(origin: ScriptedOrigin) -> None:
    with loopback_listener() as listener:
        for target in (f"http://127.0.0.1:{listener.port}/x.png", f"http://2130706433:{listener.port}/x.png",
                       f"http://[::ffff:127.0.0.1]:{listener.port}/x.png", f"http://localhost:{listener.port}/"):
            fetcher, backend = _public_fetcher(origin)
            err = refusal(fetcher, f"http://cdn.test/redirect?to={target}")
            assert err.code is ErrorCode.MEDIA_HOST_NOT_ALLOWED
            assert backend.refused == []
        assert listener.settled() == 0
    assert origin.hits["/redirect"] == 4


@pytest.mark.parametrize("target,code", [
    ("http://metadata.test/latest/meta-data/", ErrorCode.MEDIA_HOST_NOT_ALLOWED),
    ("http://169.254.169.254/latest/meta-data/", ErrorCode.MEDIA_HOST_NOT_ALLOWED),
    ("http://10.0.0.1/", ErrorCode.MEDIA_HOST_NOT_ALLOWED),
    ("file:///etc/passwd", ErrorCode.UNSUPPORTED_MEDIA_URL_SCHEME),
    ("gopher://cdn.test/_x", ErrorCode.UNSUPPORTED_MEDIA_URL_SCHEME),
    ("http://user@cdn.test/x.png", ErrorCode.INVALID_MEDIA_URL),
])
def test_redirect_to_a_refused_target_never_connects_there(origin: ScriptedOrigin, target: str,
                                                            code: ErrorCode) -> None:
    fetcher, backend = _public_fetcher(origin)
    err = refusal(fetcher, f"http://cdn.test/redirect?to={target}")
    assert err.code is code
    assert backend.calls == [(PUBLIC, 80)] and backend.refused == []


def test_redirect_loop_stops_at_the_cap_with_400(origin: ScriptedOrigin) -> None:
    origin.add("/loop", Behavior(status=302, redirect_to="/loop"))
    fetcher = MediaFetcher(FetchSettings(allow_private_hosts=True, max_redirects=3))
    err = refusal(fetcher, origin.url("/loop"))
    assert err.code is ErrorCode.MEDIA_FETCH_FAILED and err.status == 400
    assert origin.hits["/loop"] == 4


def test_relative_redirect_within_the_cap_is_followed(origin: ScriptedOrigin) -> None:
    origin.add("/final.png", Behavior(body=BODY))
    origin.add("/moved", Behavior(status=301, redirect_to="/final.png"))
    assert run(fetch_once(MediaFetcher(FetchSettings(allow_private_hosts=True)), origin.url("/moved"))) == BODY


# --- status discipline -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("status,code,http", [
    (404, ErrorCode.MEDIA_FETCH_FAILED, 400), (403, ErrorCode.MEDIA_FETCH_FAILED, 400),
    (304, ErrorCode.MEDIA_FETCH_FAILED, 400), (204, ErrorCode.MEDIA_DECODE_FAILED, 400),
    (500, ErrorCode.MEDIA_FETCH_UNAVAILABLE, 503), (503, ErrorCode.MEDIA_FETCH_UNAVAILABLE, 503),
    (429, ErrorCode.MEDIA_FETCH_UNAVAILABLE, 503),
])
def test_origin_status_maps_to_a_stable_code(origin: ScriptedOrigin, status: int, code: ErrorCode, http: int) -> None:
    origin.add("/s", Behavior(status=status, body=b"" if status in (204, 304) else b"oops"))
    err = refusal(MediaFetcher(FetchSettings(allow_private_hosts=True)), origin.url("/s"))
    assert err.code is code and err.status == http
    assert err.spec.retryable == (http == 503)


def test_refused_connection_is_retryable_503() -> None:
    with loopback_listener() as listener:
        port = listener.port
    err = refusal(MediaFetcher(FetchSettings(allow_private_hosts=True)), f"http://127.0.0.1:{port}/x")
    assert err.code is ErrorCode.MEDIA_FETCH_UNAVAILABLE and err.status == 503 and err.spec.retryable


@pytest.mark.parametrize("errno,code", [(socket.EAI_NONAME, ErrorCode.MEDIA_FETCH_FAILED),
                                        (socket.EAI_AGAIN, ErrorCode.MEDIA_FETCH_UNAVAILABLE)])
def test_name_lookup_failures(errno: int, code: ErrorCode) -> None:
    async def resolver(host: str, port: int) -> list[str]:
        raise socket.gaierror(errno, "lookup failed")

    err = refusal(MediaFetcher(FetchSettings(), resolver=resolver, transport=FailIfCalledTransport()),
                  "http://nowhere.test/x")
    assert err.code is code


def test_stall_after_headers_hits_the_read_timeout(origin: ScriptedOrigin) -> None:
    origin.add("/stall", Behavior(body=BODY, stall_s=30))
    start = time.monotonic()
    err = refusal(MediaFetcher(FetchSettings(allow_private_hosts=True, read_timeout_s=0.5)), origin.url("/stall"))
    assert err.code is ErrorCode.MEDIA_FETCH_TIMEOUT and err.status == 503 and err.spec.retryable
    assert time.monotonic() - start < 3


def test_slow_drip_hits_the_total_timeout(origin: ScriptedOrigin) -> None:
    origin.add("/drip", Behavior(body=BODY, bytes_per_second=20))
    start = time.monotonic()
    err = refusal(MediaFetcher(FetchSettings(allow_private_hosts=True, read_timeout_s=5, total_timeout_s=1.0)),
                  origin.url("/drip"))
    assert err.code is ErrorCode.MEDIA_FETCH_TIMEOUT
    assert time.monotonic() - start < 3


def test_connect_timeout_is_retryable_503() -> None:
    import httpcore

    class NeverConnects(LoopbackOnlyBackend):
        async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
            await asyncio.sleep(timeout or 0)
            raise httpcore.ConnectTimeout("timed out")

    fetcher = MediaFetcher(FetchSettings(connect_timeout_s=0.2), resolver=FakeResolver({"cdn.test": [PUBLIC]}),
                           network_backend=NeverConnects({}))
    err = refusal(fetcher, "http://cdn.test/x")
    assert err.code is ErrorCode.MEDIA_FETCH_TIMEOUT and err.status == 503


# --- byte caps ---------------------------------------------------------------------------------------------------

def test_declared_length_over_the_cap_is_413_before_the_body(origin: ScriptedOrigin) -> None:
    origin.add("/big", Behavior(body=b"x" * 5000))
    err = refusal(MediaFetcher(FetchSettings(allow_private_hosts=True)), origin.url("/big"), max_bytes=4096)
    assert err.code is ErrorCode.MEDIA_TOO_LARGE and err.status == 413


def test_undeclared_body_is_cut_at_the_cap(origin: ScriptedOrigin) -> None:
    pad = 48 * 1024 * 1024
    origin.add("/huge", Behavior(body=BODY, pad_to=pad))
    err = refusal(MediaFetcher(FetchSettings(allow_private_hosts=True)), origin.url("/huge"), max_bytes=1 << 20)
    assert err.code is ErrorCode.MEDIA_TOO_LARGE
    time.sleep(0.3)
    assert origin.bytes_sent["/huge"] < pad // 2  # reading stopped; the origin could not push it all


def test_messages_never_echo_the_url_path_or_query(origin: ScriptedOrigin) -> None:
    err = refusal(MediaFetcher(FetchSettings(allow_private_hosts=True)),
                  origin.url("/private-token-abc123/x.png?sig=SECRETSIG"))
    assert "abc123" not in err.message and "SECRETSIG" not in err.message
