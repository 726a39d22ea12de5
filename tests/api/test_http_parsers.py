"""The HTTP server's guards hold with each parser and loop (``--http-parser h11|httptools``,
``--http-loop asyncio|uvloop``; :mod:`mmgate.api.server`).

Real uvicorn on loopback with :func:`mmgate.api.server.uvicorn_config` in front of a small ASGI app, raw sockets:

* headers that never finish: 408 ``request_timeout`` and close within the header timeout; a connection that
  sends nothing is closed without an answer;
* a request on a connection opened past ``--max-connections``: 503 ``server_busy``, ``Connection: close``;
* request line + headers past 16 KiB before their end: 400 ``invalid_request`` (h11's bound on an incomplete
  event; counted for llhttp, which has none);
* two requests on one kept-alive connection both answered; the app runs on the loop asked for.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from mmgate.api.server import MAX_HEADER_BYTES, uvicorn_config
from mmgate.config.settings import parse_settings
from mmgate.cli.launch import free_port

HEADER_TIMEOUT_S = 0.5
SLACK_S = 2.0
CAP = 3


async def loop_app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    """Answers every request with the module of the running event loop's class."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = type(asyncio.get_running_loop()).__module__.encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(params=[("h11", "asyncio"), ("httptools", "asyncio"), ("httptools", "uvloop"), ("h11", "uvloop")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def server(request: pytest.FixtureRequest) -> Iterator[tuple[int, str]]:
    parser, loop = request.param
    settings = parse_settings(["--model", "unused", "--http-parser", parser, "--http-loop", loop,
                               "--http-header-timeout", str(HEADER_TIMEOUT_S), "--max-connections", str(CAP)], {})
    port = free_port()
    srv = uvicorn.Server(uvicorn_config(loop_app, settings, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started
    try:
        yield port, loop
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    start = time.monotonic()
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def error_of(response: bytes) -> tuple[int, str]:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    return int(head.split(b" ", 2)[1]), str(json.loads(body)["error"]["code"])


def get(path: str = "/") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


def test_partial_headers_get_408_within_the_header_timeout_and_silence_is_closed(server: tuple[int, str]) -> None:
    port, _ = server
    partial, silent = socket.create_connection(("127.0.0.1", port)), socket.create_connection(("127.0.0.1", port))
    partial.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    response, seconds = read_until_closed(partial, HEADER_TIMEOUT_S + SLACK_S)
    assert error_of(response) == (408, "request_timeout")
    assert HEADER_TIMEOUT_S * 0.9 <= seconds <= HEADER_TIMEOUT_S + SLACK_S
    assert read_until_closed(silent, SLACK_S)[0] == b""
    partial.close()
    silent.close()


def test_a_connection_past_the_cap_gets_503_server_busy(server: tuple[int, str]) -> None:
    port, _ = server
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP)]
    time.sleep(0.1)
    extra = socket.create_connection(("127.0.0.1", port))
    extra.sendall(get("/health"))
    assert error_of(read_until_closed(extra, SLACK_S)[0]) == (503, "server_busy")
    for sock in [*held, extra]:
        sock.close()


def test_headers_over_16_kib_get_400_invalid_request(server: tuple[int, str]) -> None:
    port, _ = server
    sock = socket.create_connection(("127.0.0.1", port))
    # not yet ended by the blank line: h11 bounds an incomplete event (a complete one in a single read passes)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * MAX_HEADER_BYTES + b"\r\n")
    assert error_of(read_until_closed(sock, SLACK_S)[0]) == (400, "invalid_request")
    sock.close()


def test_kept_alive_requests_are_answered_on_the_loop_asked_for(server: tuple[int, str]) -> None:
    port, loop = server
    sock = socket.create_connection(("127.0.0.1", port), timeout=SLACK_S)
    for _ in range(2):
        sock.sendall(get())
        data = b""
        while not data.endswith((b"uvloop", b"asyncio.unix_events")):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        assert data.startswith(b"HTTP/1.1 200 ")
        assert data.endswith(b"uvloop" if loop == "uvloop" else b"asyncio.unix_events")
    sock.close()
