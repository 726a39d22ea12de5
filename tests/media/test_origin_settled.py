"""``settled()`` of the loopback media origins (:mod:`tests.support.settle`) is a positive sync point.

A connection whose ``connect()`` (and request line) went out just before the call is counted, not
missed in the kernel's accept queue; with nothing connected the answer is no hit; a connection that
never sends its request line is waited for, then reported.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

from tests.support.servers import media_origin


def _worker_mode_origin() -> AbstractContextManager:
    from tests.worker_mode.support import origin

    return origin()


ORIGINS: dict[str, Callable[[], AbstractContextManager]] = {"media_origin": media_origin,
                                                           "worker_mode": _worker_mode_origin}


@pytest.fixture(params=list(ORIGINS))
def origin(request: pytest.FixtureRequest) -> Iterator:
    with ORIGINS[request.param]() as o:
        yield o


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def test_nothing_connected_settles_to_no_hit(origin) -> None:  # noqa: ANN001 - either origin
    assert origin.settled() == Counter()
    assert origin.connections == 0


def test_a_request_sent_just_before_the_call_is_counted(origin) -> None:  # noqa: ANN001
    for i in range(10):
        with _connect(origin.port) as sock:
            sock.sendall(f"GET /p{i}.png HTTP/1.0\r\n\r\n".encode())  # returns once the kernel has it
            hits = origin.settled()  # at once: the connection may still be in the accept queue
        assert hits[f"/p{i}.png"] == 1, hits
    assert origin.connections == 10


def test_a_connection_closed_without_a_request_is_accepted_and_no_hit(origin) -> None:  # noqa: ANN001
    _connect(origin.port).close()
    assert origin.settled() == Counter()
    assert origin.connections == 1 and origin.read == 1


def test_a_connection_that_never_sends_its_request_line_is_reported(origin) -> None:  # noqa: ANN001
    with _connect(origin.port):
        with pytest.raises(AssertionError, match="1 connections, 0 read"):
            origin.settled(timeout_s=0.3)
