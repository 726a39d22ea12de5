"""The reference engine's own handoff between disaggregated legs: a small TCP listener keyed by room.

Stage: engine, between the legs of one request.  This is **the reference engine's own transfer**,
not any real engine's (SGLang and TokenSpeed move KV with Mooncake / NIXL RDMA and a bootstrap
server, vLLM with its KV connector's side channel); it keeps only their shape: the leg that holds
the data (a prefill engine's KV cache, an encode engine's embeddings) listens on its
``--bootstrap-port``, and the leg that needs it connects with the ``(host, port, room)`` its own
request names and pulls the data once.

In: on the source side, :meth:`HandoffStore.reserve` when a request arrives, then
:meth:`~HandoffStore.publish` (a tree of tensors) or :meth:`~HandoffStore.fail`; on the consumer
side :func:`fetch`.  Out: the tree, exactly as published (tensors bit for bit).

Invariants:
  * one claim per room: a claimed payload is dropped at once (the KV is freed);
  * a payload nobody claims within ``claim_timeout_s`` is dropped (counted as ``expired``);
  * a consumer waits at most its ``wait_s`` for the room to be published; a room that never
    appears is refused with ``unknown_room``, one still being computed with ``timeout``;
  * a source that failed answers its consumer with the failure (``failed``) instead of a timeout.

Frames (both directions): 4-byte big-endian header length, a JSON header, then ``header["nbytes"]``
bytes of tensor data.  Request header: ``{"key", "wait_s"}``.  Answer: ``{"ok": true, "tree",
"tensors": [{"dtype", "shape"}...], "nbytes"}`` or ``{"ok": false, "error", "message"}``.  The tree is
JSON with tensors by index (:func:`encode_tree`); no pickle crosses the socket.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: tensor dtypes a handoff carries (the model runs float32; generator states are uint8)
_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "int64", "int32", "uint8",
                                                   "bool")}
_HEADER = struct.Struct(">I")
_MAX_HEADER = 64 << 20
_POLL_S = 0.2


class HandoffError(Exception):
    """A handoff that did not happen: ``reason`` is ``unreachable``, ``unknown_room``, ``timeout``,
    ``failed`` (the source's own failure; ``caller_fault`` when it refused the request's input),
    ``duplicate``, ``cancelled`` or ``protocol``."""

    def __init__(self, reason: str, message: str, caller_fault: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.caller_fault = caller_fault


# ---- the tree codec ------------------------------------------------------------------------------

def encode_tree(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` (dicts, lists, tuples, tensors, JSON scalars) as JSON; tensors appended to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"x": len(tensors) - 1}
    if isinstance(obj, dict):
        return {"d": {str(k): encode_tree(v, tensors) for k, v in obj.items()}}
    if isinstance(obj, tuple):
        return {"t": [encode_tree(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return {"l": [encode_tree(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise TypeError(f"a handoff cannot carry {type(obj).__name__}")


def decode_tree(node: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`encode_tree`."""
    (kind, value), = node.items()
    if kind == "x":
        return tensors[value]
    if kind == "d":
        return {k: decode_tree(v, tensors) for k, v in value.items()}
    if kind == "t":
        return tuple(decode_tree(v, tensors) for v in value)
    if kind == "l":
        return [decode_tree(v, tensors) for v in value]
    if kind == "v":
        return value
    raise HandoffError("protocol", f"unknown tree node {kind!r}")


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _tensor_from(data: memoryview, dtype_name: str, shape: list[int]) -> torch.Tensor:
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise HandoffError("protocol", f"unknown tensor dtype {dtype_name!r}")
    if not len(data):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _send(sock: socket.socket, header: dict[str, Any], blobs: Sequence[bytes] = ()) -> None:
    head = json.dumps(header).encode()
    sock.sendall(_HEADER.pack(len(head)) + head)
    for blob in blobs:
        sock.sendall(blob)


@dataclass
class _Entry:
    """One room on the source side."""

    state: str  # "pending" | "ready" | "failed"
    since: float  # time.monotonic() of the last state change
    header: dict[str, Any] = field(default_factory=dict)
    blobs: list[bytes] = field(default_factory=list)
    nbytes: int = 0


class HandoffStore:
    """The rooms a source engine holds, with their claim deadline (thread-safe)."""

    def __init__(self, claim_timeout_s: float) -> None:
        self.claim_timeout_s = claim_timeout_s
        self._rooms: dict[str, _Entry] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.published = self.claimed = self.expired = 0
        self._sweeper = threading.Thread(target=self._sweep, name="refengine-handoff-sweep", daemon=True)
        self._sweeper.start()

    def reserve(self, key: str) -> None:
        """Announce ``key``: its consumer waits for it instead of being told it is unknown.

        Raises:
            HandoffError(duplicate): the room is already held.
        """
        with self._cond:
            if key in self._rooms:
                raise HandoffError("duplicate", f"bootstrap room {key} is already in use on this engine")
            self._rooms[key] = _Entry("pending", time.monotonic())
            self._cond.notify_all()

    def publish(self, key: str, tree: Any) -> None:
        """Hold ``tree`` for one claim, for at most ``claim_timeout_s``."""
        tensors: list[torch.Tensor] = []
        encoded = encode_tree(tree, tensors)
        blobs = [_tensor_bytes(t) for t in tensors]
        header = {"ok": True, "tree": encoded, "nbytes": sum(len(b) for b in blobs),
                  "tensors": [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                               "nbytes": len(b)} for t, b in zip(tensors, blobs)]}
        with self._cond:
            self._rooms[key] = _Entry("ready", time.monotonic(), header, blobs, header["nbytes"])
            self.published += 1
            self._cond.notify_all()

    def fail(self, key: str, message: str, caller_fault: bool = False) -> None:
        """Tell ``key``'s consumer that the source failed (kept for ``claim_timeout_s``)."""
        header = {"ok": False, "error": "failed", "message": message, "caller_fault": caller_fault, "nbytes": 0}
        with self._cond:
            self._rooms[key] = _Entry("failed", time.monotonic(), header)
            self._cond.notify_all()

    def claim(self, key: str, wait_s: float) -> _Entry:
        """Take ``key``'s entry once it is ready or failed, waiting up to ``wait_s``.

        Raises:
            HandoffError(unknown_room | timeout)
        """
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                entry = self._rooms.get(key)
                if entry is not None and entry.state != "pending":
                    del self._rooms[key]
                    if entry.state == "ready":
                        self.claimed += 1
                    self._cond.notify_all()
                    return entry
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    if entry is None:
                        raise HandoffError("unknown_room", f"no request holds bootstrap room {key} on this engine")
                    raise HandoffError("timeout", f"bootstrap room {key} was not ready within {wait_s:g}s")
                self._cond.wait(left)

    def held(self) -> tuple[int, int]:
        """(rooms holding a payload, their bytes): what unclaimed handoffs keep in memory."""
        with self._cond:
            ready = [e for e in self._rooms.values() if e.state == "ready"]
            return len(ready), sum(e.nbytes for e in ready)

    def rooms(self) -> int:
        """Every room known, pending ones included."""
        with self._cond:
            return len(self._rooms)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._rooms.clear()
            self._cond.notify_all()

    def _sweep(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                stale = [k for k, e in self._rooms.items()
                         if e.state != "pending" and now - e.since >= self.claim_timeout_s]
                for key in stale:
                    entry = self._rooms.pop(key)
                    if entry.state == "ready":
                        self.expired += 1
                        logger.warning("handoff room %s was not claimed within %gs: freed %d bytes",
                                       key, self.claim_timeout_s, entry.nbytes)
                if stale:
                    self._cond.notify_all()
                deadlines = [e.since + self.claim_timeout_s for e in self._rooms.values() if e.state != "pending"]
                self._cond.wait(max(min(deadlines) - now, 0.01) if deadlines else None)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(_POLL_S)
        try:
            request, _ = _recv(sock, time.monotonic() + 10.0, None)
            key, wait_s = str(request["key"]), float(request.get("wait_s", 0.0))
        except (HandoffError, KeyError, TypeError, ValueError) as exc:
            logger.info("handoff: bad request from %s: %s", self.client_address, exc)
            return
        try:
            entry = self.server.store.claim(key, min(max(wait_s, 0.0), 3600.0))
        except HandoffError as exc:
            _send(sock, {"ok": False, "error": exc.reason, "message": exc.message, "nbytes": 0})
            return
        try:
            _send(sock, entry.header, entry.blobs)
        except OSError as exc:
            logger.warning("handoff room %s: the consumer left mid-transfer (%s); the payload is freed", key, exc)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], store: HandoffStore) -> None:
        self.store = store
        super().__init__(address, _Handler)


class HandoffServer:
    """The listener on ``host:port`` (port 0: one the OS picks; :attr:`port` is the bound one)."""

    def __init__(self, host: str, port: int, claim_timeout_s: float) -> None:
        self.store = HandoffStore(claim_timeout_s)
        self._server = _Server((host, port), self.store)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="refengine-handoff", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.store.close()
        self._server.shutdown()
        self._server.server_close()


# ---- the consumer side ---------------------------------------------------------------------------

def _recv_exact(sock: socket.socket, n: int, deadline: float, cancelled: threading.Event | None) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if cancelled is not None and cancelled.is_set():
            raise HandoffError("cancelled", "the request was cancelled while waiting for its handoff")
        if time.monotonic() > deadline:
            raise HandoffError("timeout", "the handoff did not arrive in time")
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            continue
        if k == 0:
            raise HandoffError("protocol", "the source closed the connection mid-handoff")
        got += k
    return buf


def _recv(sock: socket.socket, deadline: float, cancelled: threading.Event | None) -> tuple[dict[str, Any], bytearray]:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline, cancelled))
    if size > _MAX_HEADER:
        raise HandoffError("protocol", f"handoff header of {size} bytes")
    header = json.loads(bytes(_recv_exact(sock, size, deadline, cancelled)))
    body = _recv_exact(sock, int(header.get("nbytes", 0)), deadline, cancelled)
    return header, body


def fetch(host: str, port: int, key: str, wait_s: float, cancelled: threading.Event | None = None) -> Any:
    """Pull room ``key`` from the source engine at ``host:port``; the tree it published.

    Waits up to ``wait_s`` for the room to be published (plus the transfer itself); checks
    ``cancelled`` between reads.

    Raises:
        HandoffError: nothing listens there, the room is unknown or not ready in time, the source
            failed, or the request was cancelled.
    """
    try:
        sock = socket.create_connection((host, port), timeout=5.0)
    except OSError as exc:
        raise HandoffError("unreachable", f"no handoff listener at {host}:{port} ({exc})") from None
    with sock:
        sock.settimeout(_POLL_S)
        try:
            _send(sock, {"key": key, "wait_s": wait_s, "nbytes": 0})
            header, body = _recv(sock, time.monotonic() + wait_s + 30.0, cancelled)
        except OSError as exc:
            raise HandoffError("unreachable", f"handoff from {host}:{port} broke off ({exc})") from None
    if not header.get("ok"):
        raise HandoffError(str(header.get("error", "protocol")), str(header.get("message", "")),
                           bool(header.get("caller_fault", False)))
    tensors, offset, view = [], 0, memoryview(body)
    for spec in header["tensors"]:
        n = int(spec["nbytes"])
        tensors.append(_tensor_from(view[offset:offset + n], spec["dtype"], list(spec["shape"])))
        offset += n
    return decode_tree(header["tree"], tensors)
