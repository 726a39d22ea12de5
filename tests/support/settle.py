"""The ``settled()`` sync point of the loopback HTTP test origins (``http.server`` based).

A test that asserts an origin saw *no* request right after the gateway answered needs a positive
sync point: a client's ``connect()`` returns once the kernel has queued the connection, so a fetch
the code under test began before answering may still sit in the accept queue when the answer is
read.  The pieces here feed :meth:`SettleCounts._settled`, which waits for two accept-loop passes
after the call (the first may have begun before it; the second's ``select`` sees anything queued
before the call and accepts it) and then for every accepted connection's first request line to have
been read (its hit counted) or the connection closed.

* :class:`SettleCounts`: the counts and the wait (an origin dataclass inherits it);
* :class:`CountingServer`: a ``ThreadingHTTPServer`` that counts accepted connections and
  accept-loop passes into its ``origin``;
* :class:`ReadCounting`: a request-handler base that counts each connection's first request line
  read (or its close without one) into its ``origin``; a ``do_GET`` calls :meth:`ReadCounting._mark_read`
  right after counting its hit, so ``settled()`` does not wait for a slow body.

Serve with a short ``poll_interval`` (:data:`POLL_INTERVAL_S`): each pass of the accept loop is at
most that long, and ``settled()`` waits for two.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar

T = TypeVar("T")

POLL_INTERVAL_S = 0.05  # serve_forever(poll_interval=...) of a server whose origin is settled()


@dataclass
class SettleCounts:
    connections: int = 0  # connections accepted
    read: int = 0  # of those, the ones whose first request line was read, or that closed without one
    polls: int = 0  # passes of the accept loop (serve_forever)
    progress: threading.Condition = field(default_factory=threading.Condition)

    def _settled(self, snapshot: Callable[[], T], what: str, timeout_s: float) -> T:
        """``snapshot()`` once every connection queued before this call was accepted and its request read.

        Raises:
            AssertionError: the accept loop or a connection's first request stalled past ``timeout_s``.
        """
        with self.progress:
            start = self.polls
            if not self.progress.wait_for(lambda: self.polls >= start + 2 and self.read >= self.connections,
                                          timeout=timeout_s):
                raise AssertionError(f"{what}: not settled after {timeout_s}s "
                                     f"({self.connections} connections, {self.read} read)")
            return snapshot()

    def _count(self, name: str) -> None:
        with self.progress:
            setattr(self, name, getattr(self, name) + 1)
            self.progress.notify_all()


class CountingServer(ThreadingHTTPServer):
    """Counts accepted connections and accept-loop passes into its ``origin`` (set after construction)."""

    origin: SettleCounts

    def process_request(self, request: object, client_address: object) -> None:
        self.origin._count("connections")
        super().process_request(request, client_address)  # type: ignore[arg-type]

    def service_actions(self) -> None:
        self.origin._count("polls")


class ReadCounting(BaseHTTPRequestHandler):
    """Counts each connection's first request line read (or its close without one) into ``origin``."""

    origin: SettleCounts  # set on the subclass

    _first_read = False  # per connection (one handler instance each)

    def _mark_read(self) -> None:
        if not self._first_read:
            self._first_read = True
            self.origin._count("read")

    def parse_request(self) -> bool:
        ok = super().parse_request()  # hit counting (do_GET) comes after, in the same thread
        if not ok:
            self._mark_read()
        return ok

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._mark_read()
