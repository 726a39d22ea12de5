"""Issue 15, item 8 (and part of 10): slow, incomplete and wrong-typed HTTP requests.

Attacks with raw sockets on loopback against a real ``mmgate serve`` + ``mmgate engine``
(:func:`tests.abuse.support.running_stack`), with short limits set through the flags
(``--http-header-timeout 1 --http-body-idle-timeout 1 --http-body-timeout 3``):

* headers that never finish: 408 ``request_timeout`` and close within the header timeout;
  a connection that sends nothing is closed silently;
* a body that stops short of its Content-Length: 408 and close within the idle timeout; a body
  that drips a byte at a time: 408 at the whole-body timeout;
* 200 such sockets at once: every one answered or closed within the timeouts, the gateway's
  descriptors come back, ``/health`` answers within 1 s throughout;
* ``text/plain``, form-encoded, multipart and untyped bodies: 415 ``unsupported_media_type``;
* a client that leaves mid-upload: an INFO line, no ERROR, no traceback;
* connections past ``--max-connections``: 503 ``server_busy``, freed by the header timeout.

Each attack ends with :func:`tests.abuse.support.after_attack`.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mmgate.cli.launch import start_gateway
from tests.abuse.support import (
    HealthWatch,
    Stack,
    after_attack,
    bundle_path,
    chat_body,
    light_request,
    rss_mb,
    running_stack,
    shm_segments,
)

HEADER_TIMEOUT_S = 1.0
BODY_IDLE_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 3.0
SLACK_S = 2.0  # scheduling slack on a loaded 2-core machine
LIMIT_ARGS = ["--http-header-timeout", str(HEADER_TIMEOUT_S), "--http-body-idle-timeout", str(BODY_IDLE_TIMEOUT_S),
              "--http-body-timeout", str(BODY_TIMEOUT_S), "--log-level", "info"]

PARTIAL_HEADERS = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def short_body_request(declared: int = 1000) -> bytes:
    """Complete headers declaring ``declared`` body bytes, followed by only the first few of them."""
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(declared).encode() + b"\r\n\r\n" + b'{"model": "')


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10.0)
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and the seconds that took (raises on timeout)."""
    start = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - start
        data += chunk


def status_of(response: bytes) -> int:
    """The status code of a raw HTTP/1.1 response (0 when nothing was sent)."""
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def error_code_of(response: bytes) -> str:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    return str(json.loads(body)["error"]["code"])


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("slow-logs"), gateway_args=LIMIT_ARGS) as running:
        status, _ = light_request(running.base, running.model, timeout_s=60.0)  # warm up
        assert status == 200
        yield running


def test_headers_that_never_finish_get_408_and_close_within_the_header_timeout(stack: Stack) -> None:
    shm_before, idle_rss = shm_segments(), rss_mb(stack.gateway.proc.pid)
    with HealthWatch(stack.base) as watch:
        partial, silent = connect(stack.gateway.port), connect(stack.gateway.port)
        partial.sendall(PARTIAL_HEADERS)
        response, seconds = read_until_closed(partial, HEADER_TIMEOUT_S + SLACK_S)
        assert status_of(response) == 408 and error_code_of(response) == "request_timeout"
        assert HEADER_TIMEOUT_S * 0.9 <= seconds <= HEADER_TIMEOUT_S + SLACK_S
        # A connection that never sent a byte is closed without an answer (an idle pre-connect).
        assert read_until_closed(silent, SLACK_S)[0] == b""
        partial.close()
        silent.close()
    after_attack(stack, watch, [408], shm_before, idle_rss)


def test_body_shorter_than_content_length_gets_408_at_the_idle_timeout(stack: Stack) -> None:
    shm_before, idle_rss = shm_segments(), rss_mb(stack.gateway.proc.pid)
    with HealthWatch(stack.base) as watch:
        sock = connect(stack.gateway.port)
        sock.sendall(short_body_request())
        response, seconds = read_until_closed(sock, BODY_IDLE_TIMEOUT_S + SLACK_S)
        sock.close()
        assert status_of(response) == 408 and error_code_of(response) == "request_timeout"
        assert seconds <= BODY_IDLE_TIMEOUT_S + SLACK_S
    after_attack(stack, watch, [408], shm_before, idle_rss)


def test_body_dripping_a_byte_at_a_time_gets_408_at_the_whole_body_timeout(stack: Stack) -> None:
    shm_before = shm_segments()
    with HealthWatch(stack.base) as watch:
        sock = connect(stack.gateway.port)
        sock.sendall(short_body_request())
        start = time.monotonic()
        response = b""
        # One byte every 0.4 s stays under the 1 s idle timeout; the 3 s whole-body timeout ends it.
        while not response and time.monotonic() - start < BODY_TIMEOUT_S + SLACK_S:
            readable, _, _ = select.select([sock], [], [], 0.4)
            if readable:
                response = read_until_closed(sock, SLACK_S)[0]
            else:
                sock.sendall(b"x")
        seconds = time.monotonic() - start
        sock.close()
        assert status_of(response) == 408 and error_code_of(response) == "request_timeout"
        assert BODY_TIMEOUT_S * 0.9 <= seconds <= BODY_TIMEOUT_S + SLACK_S
    after_attack(stack, watch, [408], shm_before)


def test_200_slow_sockets_are_all_released_within_the_timeouts(stack: Stack) -> None:
    pid = stack.gateway.proc.pid
    shm_before, idle_rss, fds_before = shm_segments(), rss_mb(pid), open_fds(pid)
    statuses: list[int] = []
    with HealthWatch(stack.base) as watch:
        socks = [connect(stack.gateway.port) for _ in range(200)]
        for i, sock in enumerate(socks):
            sock.sendall(PARTIAL_HEADERS if i % 2 else short_body_request())
            sock.setblocking(False)
        start = time.monotonic()
        received = {sock: b"" for sock in socks}
        closed_after: dict[socket.socket, float] = {}
        with selectors.DefaultSelector() as sel:
            for sock in socks:
                sel.register(sock, selectors.EVENT_READ)
            while len(closed_after) < len(socks) and time.monotonic() - start < HEADER_TIMEOUT_S + 2 * SLACK_S:
                for key, _ in sel.select(timeout=0.2):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    chunk = sock.recv(65536)
                    received[sock] += chunk
                    if not chunk:
                        closed_after[sock] = time.monotonic() - start
                        sel.unregister(sock)
        for sock in socks:
            sock.close()
        statuses = [status_of(data) for data in received.values()]
    assert len(closed_after) == 200, f"{200 - len(closed_after)} slow sockets still open"
    assert max(closed_after.values()) <= max(HEADER_TIMEOUT_S, BODY_IDLE_TIMEOUT_S) + SLACK_S
    assert statuses.count(408) == 200
    deadline = time.monotonic() + 5.0
    while open_fds(pid) > fds_before + 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_fds(pid) <= fds_before + 5, "the gateway still holds the slow sockets"
    after_attack(stack, watch, statuses, shm_before, idle_rss)


@pytest.mark.parametrize("content_type", [
    "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_application_json_is_415(stack: Stack, content_type: str | None) -> None:
    shm_before = shm_segments()
    headers = {} if content_type is None else {"content-type": content_type}
    with HealthWatch(stack.base) as watch:
        resp = httpx.post(f"{stack.base}/v1/chat/completions", content=json.dumps(chat_body()).encode(),
                          headers=headers, timeout=10.0)
        assert resp.status_code == 415
        assert resp.headers["X-SMG-Error-Code"] == "unsupported_media_type"
        assert resp.json()["error"]["code"] == "unsupported_media_type"
    after_attack(stack, watch, [resp.status_code], shm_before)


def test_json_with_a_charset_parameter_is_accepted(stack: Stack) -> None:
    resp = httpx.post(f"{stack.base}/v1/chat/completions", content=json.dumps(chat_body()).encode(),
                      headers={"content-type": "Application/JSON; charset=utf-8"}, timeout=30.0)
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 1


def test_a_client_leaving_mid_upload_is_logged_at_info_without_a_traceback(stack: Stack) -> None:
    shm_before = shm_segments()
    log_path = stack.gateway.log_path
    assert log_path is not None
    log_start = log_path.stat().st_size
    with HealthWatch(stack.base) as watch:
        for _ in range(20):
            sock = connect(stack.gateway.port)
            sock.sendall(short_body_request())
            time.sleep(0.05)  # the gateway is now waiting for the rest of the body
            sock.close()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            new_log = log_path.read_bytes()[log_start:].decode(errors="replace")
            if new_log.count("client disconnected") >= 20:
                break
            time.sleep(0.1)
    assert new_log.count("INFO mmgate.api: client disconnected while sending its request body") == 20
    assert "Traceback" not in new_log and "ERROR" not in new_log, new_log[-2000:]
    metrics = httpx.get(f"{stack.base}/metrics", timeout=10.0).text
    assert 'mmgate_errors_total{code="internal_error"}' not in metrics
    after_attack(stack, watch, [], shm_before)


def test_connections_past_the_cap_get_503_server_busy_until_the_header_timeout_frees_them(
        stack: Stack, tmp_path: Path) -> None:
    cap = 20
    gateway = start_gateway(bundle_path(stack.model), [stack.engine.port], log_dir=tmp_path,
                            extra=["--served-model-name", stack.model, "--max-connections", str(cap), *LIMIT_ARGS])
    capped = Stack(engine=stack.engine, gateway=gateway, model=stack.model)
    try:
        shm_before = shm_segments()
        idle = [connect(gateway.port) for _ in range(cap + 5)]
        time.sleep(0.2)
        resp = httpx.get(f"{capped.base}/health", timeout=5.0)
        assert resp.status_code == 503
        assert resp.headers["X-SMG-Error-Code"] == "server_busy" and resp.headers["Retry-After"] == "1"
        assert resp.headers["connection"] == "close"
        for sock in idle:
            assert read_until_closed(sock, HEADER_TIMEOUT_S + SLACK_S)[0] == b""
            sock.close()
        with HealthWatch(capped.base) as watch:
            assert httpx.get(f"{capped.base}/health", timeout=5.0).status_code == 200
        after_attack(capped, watch, [resp.status_code], shm_before)
    finally:
        gateway.stop()
