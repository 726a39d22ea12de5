"""``mmgate serve --workers N``: N full gateway processes serving one port.

Stage: process management, before any request.  In: the parsed :class:`~mmgate.config.settings.Settings`
and the ``serve`` argument list; out: N child processes, each a complete gateway (``build_state`` +
``create_app`` + uvicorn) on its own ``SO_REUSEPORT`` listening socket of the same address, so the
kernel spreads new connections over them.  ``--workers 1`` (the default) never comes here:
:func:`mmgate.cli.serve` runs the gateway in its own process, as before.

Why whole processes and not one HTTP process with a preprocessing process pool: the work that
does not parallelize inside one process is on its event loop (HTTP parsing, JSON and base64,
chat templating, protobuf serialization, the gRPC call), not in the preprocessing pool, whose
decode/resize/normalize code already runs without the GIL; docs/performance.md ("Many cores")
has the measurement.

The parent (:class:`Supervisor`) holds no model, no event loop and no connection:

* start: it checks the port is free (a plain bind), binds one ``SO_REUSEPORT`` socket per
  child (not listening yet), and starts ``python -m mmgate.api.serve_child`` per socket with the
  same ``serve`` arguments (:mod:`mmgate.api.serve_child`).  A child listens once its app has started (asyncio's
  ``create_server`` calls ``listen``), then writes one byte on its ready pipe, so no
  connection waits on a process that is still loading.  Start-up ends when every child has
  written it; a child that exits first stops the others and the parent exits with its status
  (2: bad model, as ``mmgate serve``).
* run: a child that exits while the parent is not stopping is started again on a new socket of
  the same port (its half-served connections are lost; the others keep serving).  A slot whose
  child exits more than :data:`MAX_RESTARTS` times within :data:`RESTART_WINDOW_S` seconds (or that
  cannot be started again) is *quarantined*: taken out of rotation until the gateway restarts (its
  socket left the port group with its last child, so the kernel hands its share of new
  connections to the others), logged at ERROR and counted in the ``mmgate_serve_children_quarantined``
  gauge, while the healthy children keep serving.  The parent exits with status 1 only when every
  slot is quarantined: no child can serve.
* stop (SIGTERM or SIGINT): SIGTERM to every child (uvicorn's graceful shutdown: in-flight
  requests finish), SIGKILL after :data:`STOP_GRACE_S`; then the ``/dev/shm/mmgate-<pid>-*``
  segments of every dead child are unlinked and the metrics folder removed.  Status 0.  (After
  a ``kill -9`` of the parent the next ``--workers`` start removes the folder, as the next start
  of any gateway sweeps dead processes' segments.)
* children never outlive the parent: each sets ``PR_SET_PDEATHSIG`` (Linux) to SIGTERM and
  watches a pipe only the parent writes to; when it reads end-of-file (the parent is gone, even
  after ``kill -9``) it shuts down, and exits hard :data:`ORPHAN_GRACE_S` seconds later.

Per process (docs/performance.md): the in-flight budget, the pixel cache, worker health
probes and ``/health``, ``/workers``.  Shared: ``/metrics`` — the children run
prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, a private temporary
folder the parent makes and removes), and any child answers ``GET /metrics`` with the sum over
all of them (counters and histograms summed; gauges one series per process, ``pid`` label).  The
parent's one metric, ``mmgate_serve_children_quarantined`` (a ``max`` gauge: one series, no ``pid``),
is written by the parent into the same folder (:func:`publish_quarantined`).
Each child adds ``X-Mmgate-Process: <pid>`` to its responses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from mmgate.config.settings import Settings
from mmgate.transport.shm import pid_alive

log = logging.getLogger("mmgate.multiproc")

#: restarts of one slot within :data:`RESTART_WINDOW_S` seconds past which the slot is quarantined
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
#: seconds children get to finish in-flight requests after SIGTERM before SIGKILL
STOP_GRACE_S = 30.0
#: seconds an orphaned child (its parent gone) gets to shut down before it exits hard
ORPHAN_GRACE_S = 10.0
#: response header naming the process that served a request
PROCESS_HEADER = "x-mmgate-process"
ENV_PROMETHEUS_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's own variable (multiprocess mode)
#: the metrics folder of a parent: ``<tmp>/mmgate-metrics-<parent pid>-<random>``
METRICS_PREFIX = "mmgate-metrics-"
_POLL_S = 0.2


# ---------------------------------------------------------------------------- parent


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_port_free(host: str, port: int) -> int:
    """Bind ``(host, port)`` without ``SO_REUSEPORT`` and let go: the port (the one picked for ``port`` 0).

    Catches a port already served by anything, another ``--workers`` gateway included (whose
    ``SO_REUSEPORT`` sockets would otherwise accept ours into their group).

    Raises:
        OSError: the address is taken or cannot be bound.
    """
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        return int(probe.getsockname()[1])


def bind_shared(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` with ``SO_REUSEPORT`` (not listening: its child listens)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class _Slot:
    """One child position: its current process and its restart history."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    ready_fd: int = -1  # the parent's read end of the child's ready pipe; -1 once read or closed
    ready: bool = False
    restarts: deque[float] = field(default_factory=deque)
    quarantined: bool = False  # out of rotation: never started again


class Supervisor:
    """The parent of ``mmgate serve --workers N`` (see the module docstring)."""

    def __init__(self, settings: Settings, argv: Sequence[str], environ: Mapping[str, str]) -> None:
        self.settings = settings
        self.argv = list(argv)
        self.environ = dict(environ)
        self.slots = [_Slot(i) for i in range(settings.processes)]
        self.port = settings.port
        self.stopping = threading.Event()
        self._life_r = self._life_w = -1
        self._metrics_dir = ""

    def run(self) -> int:
        """Start every child, serve until SIGTERM/SIGINT, stop them; the exit status of ``mmgate serve``."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                self.port = check_port_free(self.settings.host, self.settings.port)
            except OSError as exc:
                print(f"mmgate: cannot listen on {self.settings.host}:{self.settings.port}: {exc.strerror or exc}",
                      file=sys.stderr)
                return 1
            sweep_metrics_dirs()
            self._metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")
            self._life_r, self._life_w = os.pipe()
            try:
                for slot in self.slots:
                    self._spawn(slot)
            except OSError as exc:
                print(f"mmgate: cannot start the gateway processes: {exc}", file=sys.stderr)
                return 1
            status = self._wait_ready()
            if status is not None:
                return status
            log.info("mmgate serving on http://%s:%d with %d processes (pids %s)", self.settings.host, self.port,
                     len(self.slots), " ".join(str(s.proc.pid) for s in self.slots if s.proc))
            return self._supervise()
        finally:
            self._stop_children()
            for fd in (self._life_r, self._life_w):
                if fd >= 0:
                    os.close(fd)
            if self._metrics_dir:
                shutil.rmtree(self._metrics_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping.set()

    def _spawn(self, slot: _Slot) -> None:
        sock = bind_shared(self.settings.host, self.port)
        ready_r, ready_w = os.pipe()
        try:
            args = [sys.executable, "-m", "mmgate.api.serve_child", "--index", str(slot.index),
                    "--parent-pid", str(os.getpid()), "--listen-fd", str(sock.fileno()), "--ready-fd", str(ready_w),
                    "--life-fd", str(self._life_r), "--metrics-dir", self._metrics_dir, "--", *self.argv,
                    "--workers", str(self.settings.processes)]  # ``auto`` resolved once, here
            env = self.environ | {ENV_PROMETHEUS_DIR: self._metrics_dir}
            slot.proc = subprocess.Popen(args, env=env, pass_fds=(sock.fileno(), ready_w, self._life_r))
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            sock.close()  # the child holds the only copy: its death takes the socket out of the group
            os.close(ready_w)
        slot.ready_fd, slot.ready = ready_r, False
        log.info("started gateway process %d (pid %d)", slot.index, slot.proc.pid)

    def _poll_ready(self, timeout_s: float) -> None:
        """Read the ready byte of every child that wrote it within ``timeout_s``."""
        waiting = {s.ready_fd: s for s in self.slots if s.ready_fd >= 0}
        if not waiting:
            self.stopping.wait(timeout_s)
            return
        readable, _, _ = select.select(list(waiting), [], [], timeout_s)
        for fd in readable:
            slot = waiting[fd]
            slot.ready = os.read(fd, 1) == b"R"
            os.close(fd)
            slot.ready_fd = -1
            if slot.ready and slot.proc is not None:
                log.info("gateway process %d (pid %d) is serving", slot.index, slot.proc.pid)

    def _wait_ready(self) -> int | None:
        """None when every child is serving; else the status to exit with (stopped, or a child failed)."""
        while not all(s.ready for s in self.slots):
            if self.stopping.is_set():
                return 0
            for slot in self.slots:
                code = slot.proc.poll() if slot.proc is not None else None
                if code is not None:
                    log.error("gateway process %d exited with status %d during start-up", slot.index, code)
                    self._reap(slot)
                    return code if code > 0 else 1
            self._poll_ready(_POLL_S)
        return None

    def _supervise(self) -> int:
        """Restart children that exit until stopped; 0, or 1 once every slot is quarantined."""
        while not self.stopping.is_set():
            self._poll_ready(_POLL_S)
            for slot in self.slots:
                code = slot.proc.poll() if slot.proc is not None else None
                if code is None or self.stopping.is_set():
                    continue
                log.error("gateway process %d (pid %d) exited with status %d", slot.index,
                          slot.proc.pid if slot.proc else -1, code)
                self._reap(slot)
                now = time.monotonic()
                slot.restarts.append(now)
                while slot.restarts and now - slot.restarts[0] > RESTART_WINDOW_S:
                    slot.restarts.popleft()
                if len(slot.restarts) > MAX_RESTARTS:
                    self._quarantine(slot, f"it exited {len(slot.restarts)} times within {RESTART_WINDOW_S:g} s")
                else:
                    try:
                        self._spawn(slot)
                        log.info("gateway process %d started again (pid %d)", slot.index,
                                 slot.proc.pid if slot.proc else -1)
                    except OSError as exc:
                        self._quarantine(slot, f"it cannot be started again: {exc}")
                if all(s.quarantined for s in self.slots):
                    log.error("every gateway process is out of rotation: stopping")
                    return 1
        return 0

    def _quarantine(self, slot: _Slot, why: str) -> None:
        """Take ``slot`` out of rotation (its child is reaped): log, and publish the count."""
        slot.quarantined = True
        serving = sum(1 for s in self.slots if not s.quarantined)
        log.error("gateway process %d taken out of rotation: %s; %d of %d processes serve on", slot.index, why,
                  serving, len(self.slots))
        publish_quarantined(self._metrics_dir, len(self.slots) - serving)

    def _reap(self, slot: _Slot) -> None:
        """Forget a dead child: close its ready pipe, unlink its shm segments, retire its metrics files."""
        if slot.ready_fd >= 0:
            os.close(slot.ready_fd)
            slot.ready_fd = -1
        slot.ready = False
        if slot.proc is None:
            return
        pid, slot.proc = slot.proc.pid, None
        from mmgate.transport.shm import sweep_dead_segments

        swept = sweep_dead_segments()
        if swept:
            log.info("removed %d shared-memory segments left by dead processes", swept)
        retire_metrics(self._metrics_dir, pid)

    def _stop_children(self) -> None:
        """SIGTERM every live child, SIGKILL after :data:`STOP_GRACE_S`, then reap them all."""
        live = [s for s in self.slots if s.proc is not None]
        for slot in live:
            assert slot.proc is not None
            with contextlib.suppress(ProcessLookupError):
                slot.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for slot in live:
            assert slot.proc is not None
            try:
                slot.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("gateway process %d (pid %d) did not stop in %g s: killing it", slot.index,
                            slot.proc.pid, STOP_GRACE_S)
                slot.proc.kill()
                slot.proc.wait()
            self._reap(slot)


def publish_quarantined(metrics_dir: str, count: int) -> None:
    """Set ``mmgate_serve_children_quarantined`` to ``count`` for every child's ``GET /metrics``.

    The parent runs no event loop and no prometheus registry: it writes its value into the multiprocess
    folder as prometheus_client's own multiprocess gauge would (``gauge_max_<parent pid>.db``, the key of
    ``prometheus_client.values.MultiProcessValue``); the children declare the same gauge with
    ``multiprocess_mode="max"`` (value 0), so the sum over the folder shows the parent's count.
    """
    if not metrics_dir:
        return
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from mmgate.observe.metrics import SERVE_CHILDREN_QUARANTINED_HELP as HELP
    from mmgate.observe.metrics import SERVE_CHILDREN_QUARANTINED_NAME as NAME

    values = MmapedDict(str(Path(metrics_dir) / f"gauge_max_{os.getpid()}.db"))
    try:
        values.write_value(mmap_key(NAME, NAME, [], [], HELP), float(count), 0.0)
    finally:
        values.close()


def retire_metrics(metrics_dir: str, pid: int) -> None:
    """Drop the gauge files of dead process ``pid`` (its counters and histograms stay in the sums)."""
    if not metrics_dir:
        return
    for path in Path(metrics_dir).glob(f"gauge_*_{pid}.db"):
        with contextlib.suppress(OSError):
            path.unlink()


def sweep_metrics_dirs() -> int:
    """Remove the metrics folders of parents that no longer run (one killed with SIGKILL leaves its
    folder behind); returns how many."""
    removed = 0
    for path in Path(tempfile.gettempdir()).glob(f"{METRICS_PREFIX}*"):
        pid = path.name[len(METRICS_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed

