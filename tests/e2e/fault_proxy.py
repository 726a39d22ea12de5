"""A loopback TCP proxy that injects network faults between the gateway and an engine (test support).

Stage: none of the gateway's; it sits on the wire between two real parts: the gateway's gRPC channel and
an engine's gRPC port, or a decode / EPD-prefill engine and a prefill / encode engine's bootstrap
(handoff) port.  Nothing in ``src/`` is patched: the gateway is pointed at the proxy's port instead of
the engine's.

Faults, per connection (queued with :meth:`FaultProxy.arm`, each taken by the next connection accepted)
or for the whole proxy:

* ``refuse``: accept, then reset the connection at once (RST) -- a peer that is not there;
* ``cut``: forward, and reset both sides once ``after`` bytes came back from the upstream (mid-stream;
  0 cuts before the first answer byte);
* ``delay``: hold the connection ``seconds`` before forwarding anything (a slow network; the request
  should still succeed);
* :meth:`FaultProxy.cut_all`: reset every connection now (a link that drops under live streams; a gRPC
  channel's one HTTP/2 connection carries every call in flight, so each of them fails);
* :meth:`FaultProxy.freeze`: stop forwarding anything, on live and new connections, with every socket kept
  open (a peer that hangs without closing: a frozen process, a partition) until :meth:`FaultProxy.thaw`;
* :meth:`FaultProxy.retarget`: forward new connections to another upstream port (an engine restarted on
  a new port keeps the address the gateway knows).  An upstream nobody listens on makes each new
  connection ``refuse``.

One thread per connection (``select`` on both sockets); counters in :attr:`FaultProxy.applied`.
"""

from __future__ import annotations

import collections
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Fault:
    """One connection's fault: ``kind`` ``refuse`` | ``cut`` | ``delay``."""

    kind: str
    after: int = 0  # cut: bytes from the upstream forwarded before the reset
    seconds: float = 0.0  # delay: how long nothing is forwarded

    def __post_init__(self) -> None:
        if self.kind not in ("refuse", "cut", "delay"):
            raise ValueError(f"unknown fault {self.kind!r}")


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with an RST (SO_LINGER 0), not a graceful FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class FaultProxy:
    """A proxy on ``127.0.0.1:<port>`` forwarding to ``127.0.0.1:<upstream>`` (see the module docstring)."""

    def __init__(self, upstream: int, name: str = "proxy") -> None:
        self.name = name
        self.upstream = upstream
        self.applied: collections.Counter[str] = collections.Counter()  # fault kind -> times applied
        self.connections = 0
        self._faults: collections.deque[Fault] = collections.deque()
        self._live: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._frozen = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, name=f"fault-proxy-{name}", daemon=True)
        self._thread.start()

    # ---- control ---------------------------------------------------------------------------------

    def arm(self, fault: Fault, count: int = 1) -> None:
        """Queue ``fault`` for the next ``count`` connections accepted."""
        with self._lock:
            self._faults.extend([fault] * count)

    def disarm(self) -> None:
        """Drop the faults no connection has taken yet."""
        with self._lock:
            self._faults.clear()

    def retarget(self, upstream: int) -> None:
        """Forward new connections to ``upstream`` (live ones stay where they are)."""
        with self._lock:
            self.upstream = upstream

    def freeze(self) -> None:
        """Forward nothing more (sockets stay open) until :meth:`thaw`."""
        self._frozen.set()

    def thaw(self) -> None:
        self._frozen.clear()

    def cut_all(self) -> int:
        """Reset every live connection now; how many there were."""
        with self._lock:
            live = list(self._live)
            self._live.clear()
        for sock in live:
            _reset(sock)
        if live:
            with self._lock:
                self.applied["cut_all"] += 1
        return len(live)

    def close(self) -> None:
        self._closed = True
        self._frozen.clear()
        try:
            self._listener.close()
        except OSError:
            pass
        self.cut_all()

    # ---- forwarding ------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                fault = self._faults.popleft() if self._faults else None
                upstream = self.upstream
                self.connections += 1
            threading.Thread(target=self._serve, args=(client, upstream, fault), daemon=True,
                             name=f"fault-proxy-{self.name}-conn").start()

    def _count(self, kind: str) -> None:
        with self._lock:
            self.applied[kind] += 1

    def _serve(self, client: socket.socket, upstream: int, fault: Fault | None) -> None:
        if fault is not None and fault.kind == "refuse":
            self._count("refuse")
            _reset(client)
            return
        if fault is not None and fault.kind == "delay":
            self._count("delay")
            time.sleep(fault.seconds)
        try:
            server = socket.create_connection(("127.0.0.1", upstream), timeout=5.0)
        except OSError:
            self._count("upstream_down")
            _reset(client)
            return
        server.settimeout(None)
        with self._lock:
            if self._closed:
                _reset(client)
                _reset(server)
                return
            self._live.update((client, server))
        budget = fault.after if fault is not None and fault.kind == "cut" else -1
        graceful = False
        try:
            graceful = self._pump(client, server, budget)
        finally:
            with self._lock:
                self._live.discard(client)
                self._live.discard(server)
            for sock in (client, server):
                if graceful:
                    sock.close()
                else:
                    _reset(sock)

    def _pump(self, client: socket.socket, server: socket.socket, budget: int) -> bool:
        """Copy both ways until both sides have closed (True: both ended gracefully, their FINs passed on).

        With ``budget >= 0``, stop (False: the caller resets both) once that many bytes came back from the
        upstream; a socket reset by :meth:`cut_all` or by its peer also ends it with False.
        """
        if budget == 0:
            self._count("cut")
            return False
        peer = {client: server, server: client}
        reading = [client, server]
        while reading:
            if self._frozen.is_set():
                if self._closed or client.fileno() < 0:
                    return False
                time.sleep(0.05)
                continue
            try:
                readable, _, broken = select.select(reading, [], reading, 1.0)
            except (OSError, ValueError):  # a socket closed under us (cut_all)
                return False
            if broken:
                return False
            for sock in readable:
                try:
                    data = sock.recv(65536)
                except OSError:
                    return False
                if not data:  # a graceful close: pass the FIN on, keep the other direction open
                    try:
                        peer[sock].shutdown(socket.SHUT_WR)
                    except OSError:
                        return False
                    reading.remove(sock)
                    continue
                if sock is server and budget >= 0:
                    if len(data) >= budget:
                        try:
                            client.sendall(data[:budget])
                        except OSError:
                            pass
                        self._count("cut")
                        return False
                    budget -= len(data)
                try:
                    peer[sock].sendall(data)
                except OSError:
                    return False
        return True
