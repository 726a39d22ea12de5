"""Giving freed memory back to the operating system after large requests.

Stage: process housekeeping (no request data passes through here).  In: the
encoder bytes each request holds (:meth:`IdleTrimmer.hold`); out: calls to
glibc's ``malloc_trim(0)`` once the process has gone idle after a large request.

Why: glibc keeps freed heap memory for reuse.  Large numpy buffers start out
mmapped (``M_MMAP_THRESHOLD``, 128 KiB), but glibc raises that threshold to the
size of each mmapped block it frees (up to 32 MiB on 64-bit), so the next
requests' buffers land on the heaps of the preprocessing threads' arenas and
stay resident after they are freed: after a burst of 2000x2000 images the
gateway's idle RSS stayed ~400-900 MiB above its idle value before.  Two remedies,
both from ``mallopt(3)`` / ``malloc_trim(3)``:

* :func:`set_mmap_threshold` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``),
  which also turns the dynamic adjustment off: every buffer at least that large is
  mmapped and unmapped when freed;
* :class:`IdleTrimmer` runs a full garbage collection and then ``malloc_trim(0)``
  (which also returns free pages in the middle of every arena's heaps) when the
  bytes held by requests drop to zero after a request of at least ``min_bytes``,
  debounced: ``delay_s`` after the last such release, at most once per ``delay_s``,
  in a worker thread.  The collection matters as much as the trim: an idle
  process allocates nothing, so the cyclic collector never runs on its own, and
  reference cycles left by finished requests (frames, futures) keep their
  buffers alive (measured: ~100-150 MiB of a 24-request burst).

Under load the opposite matters: a request's inline ``pixel_values`` (29.5 MB for a 1280x960 Qwen3-VL
image) and grpc's copy of the request are allocated and freed once per request.  Served by mmap (glibc's
dynamic threshold starts at 128 KiB) or trimmed off the heap's top after every free, each request faults
its ~60 MB in again: ~14,400 minor faults and ~27 ms of CPU per request at c=1 (``benchmarks/e2e_gateway.py``,
inline 1280x960: 50.5 ms CPU/request against 23.2 ms with the defaults below).  The gateway's defaults
(``--malloc-mmap-threshold 32 MiB``, glibc's largest, and ``--malloc-trim-threshold 64 MiB``) keep blocks up to
32 MiB on the heap and up to 64 MiB of free memory at its top between requests; with one arena
(``--malloc-arena-max 1``: ``malloc_trim`` cannot return the free top of a thread arena's heap, measured
+40 MiB left after the idle trim with glibc's 8 per core) the idle trim above returns the rest once the
gateway is idle.  Peak RSS stayed at or below the Rust gateway's in every cell of the
benchmark (docs/performance.md).

On a C library other than glibc all of these are no-ops that return ``False``.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger("mmgate.memory")

#: ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (glibc ``malloc.h``)
M_MMAP_THRESHOLD = -3
#: ``mallopt`` parameter number of ``M_TRIM_THRESHOLD`` (glibc ``malloc.h``)
M_TRIM_THRESHOLD = -1
#: ``mallopt`` parameter number of ``M_ARENA_MAX`` (glibc ``malloc.h``)
M_ARENA_MAX = -8
#: glibc's largest accepted ``M_MMAP_THRESHOLD`` on 64-bit (``HEAP_MAX_SIZE / 2``)
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(lib, "malloc_trim") or not hasattr(lib, "mallopt"):
        return None  # not glibc
    return lib


_LIBC = _libc()


def trim() -> bool:
    """Return free heap memory to the OS (glibc ``malloc_trim(0)``).

    Returns:
        Whether memory was released (``False`` too when the C library is not glibc).
    """
    if _LIBC is None:
        return False
    return bool(_LIBC.malloc_trim(0))


def release_startup_garbage() -> bool:
    """Collect and trim once the model is loaded: parsing ``tokenizer.json`` (the ``tokenizers`` crate's serde
    reader) leaves its transient allocations on the heap, ~35-55 MiB for Qwen's 11 MB file (RSS 208 -> 153 MiB
    after ``build_state`` for Qwen3-VL; ``benchmarks/e2e_gateway.py`` reports the idle RSS of both gateways).

    Returns:
        Whether ``malloc_trim`` released memory (``False`` too when the C library is not glibc).
    """
    gc.collect()
    return trim()


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve every allocation of at least ``nbytes`` bytes with its own mmap, and turn glibc's
    dynamic threshold off (``mallopt(M_MMAP_THRESHOLD, nbytes)``).

    Raises:
        ValueError: ``nbytes`` not in ``1 .. MAX_MMAP_THRESHOLD``.

    Returns:
        Whether the C library took it (``False`` when it is not glibc).
    """
    if not 0 < nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap threshold must be 1..{MAX_MMAP_THRESHOLD} bytes")
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)))


def set_trim_threshold(nbytes: int) -> bool:
    """Keep up to ``nbytes`` of free memory at the top of the heap instead of returning it at every ``free``
    (``mallopt(M_TRIM_THRESHOLD, nbytes)``; also turns glibc's dynamic adjustment off).

    Raises:
        ValueError: ``nbytes`` not positive or above 2**31 - 1.

    Returns:
        Whether the C library took it (``False`` when it is not glibc).
    """
    if not 0 < nbytes < 2**31:
        raise ValueError("trim threshold must be 1..2**31-1 bytes")
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(nbytes)))


def set_arena_max(arenas: int) -> bool:
    """Let at most ``arenas`` malloc arenas exist (``mallopt(M_ARENA_MAX, arenas)``); threads that start after
    this share them.  ``malloc_trim`` returns free pages anywhere in the main arena but not the free top of a
    thread arena's heap, so with one arena the idle trim gives everything back.

    Raises:
        ValueError: ``arenas`` < 1.

    Returns:
        Whether the C library took it (``False`` when it is not glibc).
    """
    if arenas < 1:
        raise ValueError("arena count must be at least 1")
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(M_ARENA_MAX, ctypes.c_int(arenas)))


class IdleTrimmer:
    """Trims the heap when the process goes idle after a large request (event-loop confined).

    ``min_bytes``: a request holding at least this many bytes marks the heap for trimming;
    ``delay_s``: seconds of idleness (nothing held) before the trim, and the least time between two trims.
    """

    def __init__(self, min_bytes: int, delay_s: float = 1.0, trim_fn: Callable[[], bool] = trim) -> None:
        if min_bytes <= 0 or delay_s < 0:
            raise ValueError("min_bytes must be positive and delay_s not negative")
        self.min_bytes = min_bytes
        self.delay_s = delay_s
        self.held = 0  # bytes held by requests now
        self.trims = 0  # trims run so far
        self._dirty = False  # a large request ran since the last trim
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0  # time.monotonic() of the last trim
        self._trim_fn = trim_fn

    def hold(self, nbytes: int) -> Callable[[], None]:
        """Count ``nbytes`` as held by a request; returns an idempotent release."""
        self.held += nbytes
        if nbytes >= self.min_bytes:
            self._dirty = True
        if self._timer is not None:  # busy again: the idle trim waits
            self._timer.cancel()
            self._timer = None
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.held -= nbytes
            if self.held == 0 and self._dirty:
                self._schedule()

        return release

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        wait = max(self.delay_s, self._last + self.delay_s - time.monotonic())
        self._timer = loop.call_later(wait, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self.held != 0 or not self._dirty:
            return
        self._dirty = False
        self._last = time.monotonic()
        self.trims += 1
        asyncio.get_running_loop().run_in_executor(None, self._run)

    def _run(self) -> None:
        start = time.perf_counter()
        collected = gc.collect()
        released = self._trim_fn()
        log.debug("idle trim: %d objects collected, malloc_trim %s, %.1f ms", collected,
                  "released memory" if released else "released nothing", (time.perf_counter() - start) * 1e3)


def configure(mmap_threshold: int, trim_min_bytes: int, trim_threshold: int = 0,
              arena_max: int = 0) -> IdleTrimmer | None:
    """Apply the gateway's memory settings at start-up (before the preprocessing and gRPC threads start): a
    fixed mmap threshold when ``mmap_threshold`` is not 0, a fixed trim threshold when ``trim_threshold`` is
    not 0, an arena cap when ``arena_max`` is not 0, and the idle trimmer that
    :class:`mmgate.pipeline.budget.InflightBudget` feeds when ``trim_min_bytes`` is not 0 (``--malloc-mmap-threshold``,
    ``--malloc-trim-threshold``, ``--malloc-arena-max``, ``--memory-trim-min-bytes``).

    Raises:
        ValueError: a threshold outside ``1 .. MAX_MMAP_THRESHOLD`` (mmap) or ``1 .. 2**31-1`` (trim).
    """
    if mmap_threshold:
        set_mmap_threshold(mmap_threshold)
    if trim_threshold:
        set_trim_threshold(trim_threshold)
    if arena_max:
        set_arena_max(arena_max)
    return IdleTrimmer(trim_min_bytes) if trim_min_bytes > 0 else None
