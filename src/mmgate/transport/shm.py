"""POSIX shared-memory tensor transport (``/dev/shm``).

Stage: transport.  The gateway writes a tensor's raw little-endian bytes into
its own ``/dev/shm`` segment and sends a ``ShmHandle`` (name, offset, nbytes,
owner) instead of inline bytes; the consumer reads, then unlinks.

Life cycle (the gateway owns every segment it creates until it is gone):
* create: ``mmgate-<pid>-<random>``, ``O_CREAT | O_EXCL``, mode 0600;
* hand over: the name travels in the request;
* unlink: the consumer unlinks after reading (SMG convention,
  ``smg_grpc_servicer/mm_shm.py``); the gateway also unlinks every segment of
  a request once the engine has answered or the request failed, was cancelled
  or the client went away (:class:`ShmLease` is a context manager) — unlinking
  twice is harmless;
* sweep: at start, segments named ``mmgate-<pid>-*`` whose process is dead are
  unlinked (crash leftovers).

Names are validated on both sides: no ``/``, no ``..``, no NUL, not empty.
Worker compatibility under ``auto``: shared memory is used only when the
worker's ``shm_namespace_id`` label equals ours (``<boot_id>:<st_dev of
/dev/shm>``), i.e. both processes see the same tmpfs.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
from functools import lru_cache

import numpy as np

SHM_DIR = "/dev/shm"
PREFIX = "mmgate-"


class ShmError(Exception):
    """A shared-memory segment could not be written or read."""


@lru_cache(maxsize=1)
def shm_namespace_id() -> str:
    """This process's ``/dev/shm`` identity ``<boot_id>:<st_dev>`` ('' when unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot_id = fh.read().strip()
        return f"{boot_id}:{os.stat(SHM_DIR).st_dev}"
    except OSError:
        return ""


def validate_name(name: str) -> str:
    """The bare segment name.

    Raises:
        ShmError: empty, ``.``/``..``, containing ``/`` (after one leading ``/``) or NUL.
    """
    bare = name[1:] if name.startswith("/") else name
    if not bare or bare in (".", "..") or "/" in bare or "\x00" in bare or ".." in bare:
        raise ShmError("invalid shared-memory segment name")
    return bare


def create_segment(nbytes: int, reserve: bool = True) -> str:
    """Create a new segment of ``nbytes`` bytes; returns its name.

    ``reserve``: allocate its memory now (``posix_fallocate``), so a full
    ``/dev/shm`` fails here rather than halfway through writing; without it the
    segment is sized (``ftruncate``) and its pages come with the writes.

    Raises:
        ShmError: the segment could not be created or reserved (nothing is left behind).
    """
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ShmError(f"cannot create segment ({errno.errorcode.get(exc.errno or 0, exc.errno)})") from None
    try:
        if nbytes and reserve:
            os.posix_fallocate(fd, 0, nbytes)
        elif nbytes:
            os.ftruncate(fd, nbytes)
    except OSError as exc:
        unlink(name)
        raise ShmError(f"cannot reserve segment ({errno.errorcode.get(exc.errno or 0, exc.errno)})") from None
    finally:
        os.close(fd)
    return name


class SegmentWriter:
    """Writes into a segment made by :func:`create_segment` through its own descriptor.

    A context manager, so each writer (one per pool task) owns and closes its
    descriptor: a request that ends while a task still writes only unlinks the
    name; the memory goes when the last descriptor closes.

    Raises:
        ShmError: the segment is gone (the request ended), or a write failed.
    """

    def __init__(self, name: str) -> None:
        try:
            self._fd = os.open(os.path.join(SHM_DIR, validate_name(name)), os.O_WRONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ShmError(f"cannot open segment ({errno.errorcode.get(exc.errno or 0, exc.errno)})") from None

    def write(self, offset: int, data: np.ndarray) -> None:
        """Write ``data``'s bytes (C order) at byte ``offset``."""
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        written, total = 0, len(view)
        try:
            while written < total:
                n = os.pwrite(self._fd, view[written:], offset + written)
                if n <= 0:
                    raise OSError(errno.EIO, "short write")
                written += n
        except OSError as exc:
            raise ShmError(f"cannot write segment ({errno.errorcode.get(exc.errno or 0, exc.errno)})") from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_segment(array: np.ndarray) -> str:
    """Write ``array``'s bytes (C order) into a new segment; returns its name.

    Raises:
        ShmError: the segment could not be created or fully written (the partial
            segment is removed).
    """
    name = create_segment(array.nbytes)
    try:
        with SegmentWriter(name) as writer:
            writer.write(0, array)
    except ShmError:
        unlink(name)
        raise
    return name


def read_segment(name: str, offset: int, nbytes: int, unlink_after: bool = True) -> bytes:
    """Read ``nbytes`` at ``offset`` from a segment (never following symlinks), then unlink it.

    Raises:
        ShmError: invalid name, missing segment, not a regular file, or short read.
    """
    bare = validate_name(name)
    path = os.path.join(SHM_DIR, bare)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ShmError(f"cannot open segment ({errno.errorcode.get(exc.errno or 0, exc.errno)})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ShmError("segment is not a regular file")
        raw = os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)
        if unlink_after:
            unlink(bare)
    if len(raw) != nbytes:
        raise ShmError(f"segment holds {len(raw)} bytes, {nbytes} expected")
    return raw


def unlink(name: str) -> bool:
    """Remove a segment; False when it was already gone."""
    try:
        os.unlink(os.path.join(SHM_DIR, validate_name(name)))
    except FileNotFoundError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (``kill(pid, 0)``; one owned by another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead_segments() -> int:
    """Unlink ``mmgate-<pid>-*`` segments whose process no longer exists; returns how many."""
    removed = 0
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for entry in entries:
        if not entry.startswith(PREFIX):
            continue
        pid_text = entry[len(PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and not pid_alive(int(pid_text)):
            removed += unlink(entry)
    return removed


class ShmLease:
    """The segments of one request; unlinks whatever is left when the request ends.

    Thread-safe: a segment created by a pool task after the request ended
    (``release`` already called) is unlinked at once by :meth:`add`.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self._closed = False
        self._lock = threading.Lock()

    def add(self, name: str) -> None:
        with self._lock:
            if not self._closed:
                self.names.append(name)
                return
        unlink(name)

    def release(self) -> int:
        """Unlink every segment still present (and any added later); returns how many were still there."""
        with self._lock:
            self._closed = True
            names, self.names = self.names, []
        return sum(1 for n in names if unlink(n))

    def __enter__(self) -> ShmLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
