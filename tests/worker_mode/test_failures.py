"""Failures keep their cause from the gateway through the engine (and the sidecar) back to the client.

The same broken media through each path: router mode (the gateway fetches),
worker mode in process (the engine fetches) and worker mode via the Redis
sidecar (the sidecar fetches).  Each gives the same stable code, the same
HTTP status, and names the same content part: the caller's mistakes are 400,
transient faults retryable 503.
"""

from __future__ import annotations

import pytest

from mmgate.cli.launch import free_port
from tests.worker_mode.conftest import Stack
from tests.worker_mode.support import Gateway, Origin, chat, data_url, image_bytes, image_part

CASES = {
    # name: (url factory, HTTP status, code)
    "origin_404": (lambda o: o.url("/missing.png"), 400, "media_fetch_failed"),
    "host_not_on_allow_list": (lambda o: o.add("/ok.png", image_bytes(32, 32, 3)).replace("127.0.0.1", "localhost"),
                               400, "media_host_not_allowed"),
    "undecodable": (lambda o: data_url(b"this is not an image" * 8), 400, "media_decode_failed"),
    "origin_5xx": (lambda o: o.url("/status/502"), 503, "media_fetch_unavailable"),
    "refused_connection": (lambda o: f"http://127.0.0.1:{free_port()}/x.png", 503, "media_fetch_unavailable"),
    "fetch_timeout": (lambda o: o.add("/ok.png", image_bytes(32, 32, 3)).replace("/ok.png", "/slow/ok.png"),
                      503, "media_fetch_timeout"),
}


@pytest.mark.parametrize("path", ["router", "inprocess", "sidecar"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_media_failure_has_the_same_code_and_status_on_every_path(
        live: Stack, gateways: dict[str, Gateway], media: Origin, path: str, case: str) -> None:
    make_url, status, code = CASES[case]
    body = chat([{"type": "text", "text": "Look:"}, image_part(make_url(media))])
    resp = gateways[path].post(body)
    assert resp.status_code == status, resp.text
    assert resp.headers["X-SMG-Error-Code"] == code
    error = resp.json()["error"]
    assert error["code"] == code and error["param"] == "messages[0].content[1]"
    assert ("Retry-After" in resp.headers) == (status == 503)
