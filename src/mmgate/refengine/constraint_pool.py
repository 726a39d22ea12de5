"""Compile structured-output constraints in child processes, with a deadline, a memory cap and a cache.

Stage: engine request intake, on the request's own gRPC handler thread, before the request
reaches a model thread (:mod:`.core`).  In: the request's :class:`~mmgate.types.Constraint`
and its cancel flag; out: an ``xgr.CompiledGrammar`` for this engine's tokenizer (which
:class:`~.constraints.GrammarGuide` applies on the model thread), or a refusal.

Why children: xgrammar compiles on the calling thread, holds it for as long as the
constraint takes and cannot be interrupted, and some constraints crash it (issue 20:
a JSON-schema ``pattern`` of 50,000 nested groups overflows its C stack, SIGSEGV; an
enum of 100,000 values took 167 s; 1,024 choices of 10 KB reached 2.9 GB).  Each
compile runs in a :mod:`.constraint_worker` child (``sys.executable``, importing
xgrammar only, never the engine's model code), which sends back
``CompiledGrammar.serialize_json()``; the engine deserializes it against its own
``TokenizerInfo`` (built once here and sent to each child, so the child loads no
tokenizer).  Measured on the Qwen2-VL vocabulary (151,936 ids, 2 busy cores): a child
is ready 1.7 s after it is started (importing xgrammar, which imports torch, is most of
it) and holds about 370 MB of private memory; a small schema compiles in 0.34 ms in
process and 1.9 ms through a warm child, ``json_object`` in 15.5 ms and 23 ms.

Outcomes (the request's answer; :func:`~.core.grpc_status` turns a ``GatewayError`` into
its gRPC status, the gateway maps it back):
  * compiled: cached here by ``(kind, value)`` (one pool per engine, so per tokenizer;
    :data:`CACHE_BYTES` of ``CompiledGrammar.memory_size_bytes``, least recently used
    first out) and returned; the child serves the next compile;
  * xgrammar refuses it (a bad schema, regex or grammar): ``invalid_request`` (the
    gateway reports ``engine_rejected``), the child kept;
  * past ``--constraint-compile-timeout`` (counted from the moment the child has it),
    over ``--constraint-compile-memory`` (``std::bad_alloc`` under the child's
    ``RLIMIT_AS``), or the child crashed: ``constraint_too_complex`` (400), the child
    killed (or reaped) and a fresh one started;
  * the request cancelled (client gone, its deadline passed, Abort) while it waited or
    compiled: :class:`CompileCancelled`, the child killed and replaced within
    :data:`POLL_S`.

Children: started on demand (the first constrained request pays one start-up; a request
that finds every child busy starts another, up to ``--constraint-compile-workers``) and
kept warm; each compiles one constraint at a time, so a slow compile holds one child and
other constrained requests use the others (or wait their turn), while requests without a
constraint never wait here.  They are started by one supervisor thread, whose end kills
them (``PR_SET_PDEATHSIG``), as does the serving process's death.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import xgrammar as xgr

from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.bundle import LazyTokenizer
from mmgate.refengine.config import CompileLimits
from mmgate.refengine.constraint_worker import ERROR, GRAMMAR, READY
from mmgate.types import Constraint

logger = logging.getLogger("mmgate.refengine")

#: how often a waiting compile looks at its cancel flag and deadline
POLL_S = 0.05
#: a child that is not ready by then (its imports, on a loaded machine) is given up
START_TIMEOUT_S = 120.0
#: compiled grammars kept, by their ``memory_size_bytes``
CACHE_BYTES = 256 << 20
#: the child: the folder holding this ``mmgate`` package first on its path, then the worker's main
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from mmgate.refengine.constraint_worker import main; sys.exit(main(sys.argv[2:]))")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class CompileCancelled(Exception):
    """The request was cancelled while its constraint waited for a child or compiled."""


class _Child:
    """One started :mod:`.constraint_worker` process and our end of its socket."""

    def __init__(self, process: subprocess.Popen[bytes], conn: Connection) -> None:
        self.process = process
        self.conn = conn

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> int:
        """Kill and reap the child; its exit status (negative: the signal that ended it)."""
        if self.process.poll() is None:
            self.process.kill()
        code = self.process.wait()
        self.conn.close()
        return code


@dataclass(frozen=True, slots=True)
class _SpawnFailed:
    """A child that could not be started (in place of a child, for the request waiting on it)."""

    message: str


def _ended(code: int) -> str:
    """``-11`` -> ``"SIGSEGV"``; ``3`` -> ``"exit status 3"``."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


class ConstraintCompiler:
    """The engine's constraint compiler: children, deadline, memory cap, cache (module docstring)."""

    def __init__(self, tokenizer: LazyTokenizer, vocab_size: int, limits: CompileLimits) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.limits = limits
        self._lock = threading.Lock()
        self._idle: queue.Queue[_Child | _SpawnFailed] = queue.Queue()
        self._spawns: queue.Queue[bool] = queue.Queue()  # True: start a child; False: the supervisor stops
        self._children: dict[int, _Child] = {}  # every running child by pid, idle or busy
        self._busy: set[int] = set()
        self._wanted = 0  # children running or being started
        self._supervisor: threading.Thread | None = None
        self._info: xgr.TokenizerInfo | None = None
        self._info_json = b""  # ``self._info`` serialized, as each child is sent it
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._closed = False

    # ---- the request's compile -------------------------------------------------------------------

    def compile(self, constraint: Constraint, cancelled: threading.Event) -> xgr.CompiledGrammar:
        """``constraint`` compiled for this engine's tokenizer (from the cache, else in a child).

        Blocks the calling thread (a gRPC handler's, never a model thread's) for at most the
        wait for a free child plus ``limits.timeout_s``.

        Raises:
            GatewayError(INVALID_REQUEST): xgrammar refuses the constraint.
            GatewayError(CONSTRAINT_TOO_COMPLEX): past the deadline, over the memory cap, or it
                crashed the child.
            GatewayError(INTERNAL_ERROR): no child could be started.
            CompileCancelled: ``cancelled`` was set first (or the engine is stopping).
        """
        key = (constraint.kind.value, constraint.value)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        child = self._acquire(cancelled)
        reply = self._run(child, constraint, cancelled)
        assert self._info is not None  # built before the first child started
        compiled = xgr.CompiledGrammar.deserialize_json(reply.decode(), self._info)
        self._remember(key, compiled)
        return compiled

    def _acquire(self, cancelled: threading.Event) -> _Child:
        """An idle child (one more started when none is idle and fewer than ``workers`` run)."""
        with self._lock:
            if self._supervisor is None:
                self._supervisor = threading.Thread(target=self._supervise, name="refengine-constraints",
                                                    daemon=True)
                self._supervisor.start()
        while True:
            if cancelled.is_set() or self._closed:
                raise CompileCancelled()
            with self._lock:
                if self._idle.empty() and self._wanted < self.limits.workers:
                    self._wanted += 1
                    self._spawns.put(True)
            try:
                item = self._idle.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if isinstance(item, _SpawnFailed):
                raise GatewayError(ErrorCode.INTERNAL_ERROR, f"the constraint compiler cannot start: {item.message}")
            if item.process.poll() is not None:  # died while idle
                self._discard(item)
                continue
            with self._lock:
                self._busy.add(item.pid)
            return item

    def _run(self, child: _Child, constraint: Constraint, cancelled: threading.Event) -> bytes:
        """The child's serialized grammar for ``constraint``; every refusal raised (see :meth:`compile`)."""
        kind = constraint.kind.value
        try:
            child.conn.send_bytes(json.dumps({"kind": kind, "value": constraint.value}).encode())
            deadline = time.monotonic() + self.limits.timeout_s
            while not child.conn.poll(POLL_S):
                if cancelled.is_set() or self._closed:
                    self._discard(child)
                    raise CompileCancelled()
                if time.monotonic() >= deadline:
                    self._discard(child)
                    raise GatewayError(ErrorCode.CONSTRAINT_TOO_COMPLEX,
                                       f"the {kind} constraint did not compile within {self.limits.timeout_s:g} s "
                                       "(--constraint-compile-timeout); its compile was abandoned")
            reply = child.conn.recv_bytes()
        except (EOFError, OSError):  # the child died mid-compile (or close() killed it)
            if self._closed:
                raise CompileCancelled() from None
            ended = _ended(self._discard(child))
            logger.warning("a %s constraint crashed its compiler process (%s); another is started", kind, ended)
            raise GatewayError(ErrorCode.CONSTRAINT_TOO_COMPLEX,
                               f"the {kind} constraint crashed the constraint compiler ({ended})") from None
        if reply[:1] == GRAMMAR:
            self._release(child)
            return reply[1:]
        refusal = json.loads(reply[1:]) if reply[:1] == ERROR else {"error": "protocol", "memory": False}
        if refusal["memory"]:  # its heap grew to the cap: start afresh
            self._discard(child)
            raise GatewayError(ErrorCode.CONSTRAINT_TOO_COMPLEX,
                               f"the {kind} constraint needs more than {self.limits.memory_bytes >> 20} MiB to "
                               "compile (--constraint-compile-memory)")
        self._release(child)
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"the {kind} constraint does not compile: {refusal['error']}")

    def _remember(self, key: tuple[str, str], compiled: xgr.CompiledGrammar) -> None:
        size = int(compiled.memory_size_bytes)
        if size > CACHE_BYTES:
            return
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = compiled
            self._cache_bytes += size
            while self._cache_bytes > CACHE_BYTES:
                _, dropped = self._cache.popitem(last=False)
                self._cache_bytes -= int(dropped.memory_size_bytes)

    # ---- children --------------------------------------------------------------------------------

    def _release(self, child: _Child) -> None:
        with self._lock:
            self._busy.discard(child.pid)
        self._idle.put(child)

    def _discard(self, child: _Child) -> int:
        """Kill (or reap) ``child`` and start another in its place; its exit status."""
        code = child.kill()
        with self._lock:
            self._children.pop(child.pid, None)
            self._busy.discard(child.pid)
            if self._closed:
                self._wanted -= 1
            else:
                self._spawns.put(True)
        return code

    def _supervise(self) -> None:
        """The one thread that starts children (they die with it: ``PR_SET_PDEATHSIG``)."""
        while self._spawns.get():
            try:
                child = self._start_child()
            except Exception as exc:  # noqa: BLE001 - the waiting request hears of it
                logger.error("cannot start a constraint compiler process: %s", exc)
                with self._lock:
                    self._wanted -= 1
                self._idle.put(_SpawnFailed(str(exc)))
                continue
            with self._lock:
                closed = self._closed
                if not closed:
                    self._children[child.pid] = child
            if closed:
                child.kill()
            else:
                self._idle.put(child)

    def _tokenizer_info_json(self) -> bytes:
        """This engine's ``TokenizerInfo`` (built on first use: the real vocabulary, padded to the
        model's ``vocab_size``), serialized for the children."""
        if self._info is None:
            self._info = xgr.TokenizerInfo.from_huggingface(self._tokenizer.get(), vocab_size=self._vocab_size)
            self._info_json = self._info.serialize_json().encode()
        return self._info_json

    def _start_child(self) -> _Child:
        """Start one child and wait until it is ready.

        Raises:
            OSError: it could not be started, or died or stayed silent before it was ready.
        """
        info = self._tokenizer_info_json()
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, _PACKAGE_ROOT, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        child = _Child(process, Connection(ours.detach()))
        try:
            child.conn.send_bytes(json.dumps({"memory_bytes": self.limits.memory_bytes}).encode())
            child.conn.send_bytes(info)
            if not child.conn.poll(START_TIMEOUT_S) or child.conn.recv_bytes() != READY:
                raise OSError(f"not ready within {START_TIMEOUT_S:g} s")
        except (OSError, EOFError) as exc:
            raise OSError(f"the constraint compiler process ended before it was ready "
                          f"({_ended(child.kill())}): {exc}") from None
        return child

    # ---- the engine's view -----------------------------------------------------------------------

    def pids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(every running child's pid, the busy ones')."""
        with self._lock:
            return tuple(self._children), tuple(self._busy)

    def close(self) -> None:
        """Kill every child and stop the supervisor (compiles waiting end with :class:`CompileCancelled`)."""
        with self._lock:
            self._closed = True
            children = list(self._children.values())
            self._children.clear()
        for child in children:
            child.kill()
        self._spawns.put(False)
