"""SSRF through the real HTTP API, default policy: every refused form is a 400, and nothing is dialled.

The gateway app runs in a thread; its fetcher's resolver answers test names
from a table (``localhost`` from the system resolver) and its socket layer
fails the test if it is ever called, so no packet can leave for a private,
link-local, CGNAT or metadata address even if the policy were wrong.
Loopback forms also target a live loopback listener that must see no
connection, once more through a gateway whose fetcher is not modified at
all (system resolver, real sockets).  The worker address is a closed port:
refusals come first.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from mmgate.cli.launch import free_port
from mmgate.config.settings import Settings
from tests.conftest import bundle_dir
from tests.media.gateways import RoutedResolver, ssrf_gateway
from tests.media.hostile_urls import LOOPBACK_HOSTS, NON_PUBLIC_URLS
from tests.media.netfakes import (
    FailIfCalledBackend,
    LoopbackListener,
    loopback_listener,
)
from tests.support.servers import gateway_in_thread

MODEL = "Qwen/Qwen2-VL-2B-Instruct"


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, FailIfCalledBackend, RoutedResolver, LoopbackListener]]:
    table: dict[str, list[str]] = {}
    for _, names in NON_PUBLIC_URLS:
        table.update(names)
    backend, resolver = FailIfCalledBackend(), RoutedResolver(table)
    with loopback_listener() as listener, ssrf_gateway(bundle_dir(MODEL), MODEL, free_port(), backend,
                                                        resolver) as base:
        yield base, backend, resolver, listener


def _ask(base: str, url: str) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe."}]}]}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=30)


@pytest.mark.parametrize("url", [u for u, _ in NON_PUBLIC_URLS])
def test_private_link_local_cgnat_and_metadata_targets_are_400_with_no_connection(gateway, url: str) -> None:
    base, backend, _, _ = gateway
    resp = _ask(base, url)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "media_host_not_allowed"
    assert resp.json()["error"]["param"] == "messages[0].content[0]"
    assert backend.calls == []


@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
def test_loopback_forms_are_400_and_the_listener_sees_no_connection(gateway, host: str) -> None:
    base, backend, _, listener = gateway
    resp = _ask(base, f"http://{host}:{listener.port}/x.png")
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] in ("media_host_not_allowed", "invalid_media_url")
    assert listener.settled() == 0 and backend.calls == []


@pytest.mark.parametrize("url,code", [
    ("file:///etc/passwd", "unsupported_media_url_scheme"),
    ("gopher://127.0.0.1:70/_x", "unsupported_media_url_scheme"),
    ("ftp://127.0.0.1/x.png", "unsupported_media_url_scheme"),
    ("http://allowed.example@127.0.0.1/x.png", "invalid_media_url"),
    ("http://user:pass@metadata.google.internal/", "invalid_media_url"),
])
def test_schemes_and_userinfo_are_400_before_any_lookup(gateway, url: str, code: str) -> None:
    base, backend, resolver, _ = gateway
    before = len(resolver.calls)
    resp = _ask(base, url)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == code
    assert "root:" not in resp.text and "pass" not in resp.json()["error"]["message"]
    assert len(resolver.calls) == before and backend.calls == []


@pytest.fixture(scope="module")
def plain_gateway() -> Iterator[str]:
    """The gateway as deployed: default policy, system resolver, real connection layer."""
    settings = Settings(model=str(bundle_dir(MODEL)), served_model_name=MODEL,
                        worker_urls=(f"grpc://127.0.0.1:{free_port()}",))
    with gateway_in_thread(settings) as base:
        yield base


@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
def test_loopback_forms_through_the_unmodified_fetcher_reach_no_listener(plain_gateway: str, host: str) -> None:
    with loopback_listener() as listener:
        resp = _ask(plain_gateway, f"http://{host}:{listener.port}/x.png")
        assert resp.status_code == 400, resp.text
        assert listener.settled() == 0
