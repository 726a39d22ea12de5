"""Row targets: where a :class:`~mmgate.types.PendingTensor` writes its rows.

Stage: transport.  The engine adapter picks the buffer that will carry the
tensor and the pipeline's pool tasks write each block of rows into it once,
converted to the wire dtype on the way (float32 -> bfloat16/float16 is
elementwise, so converting block by block gives the same bytes as converting
the whole tensor):

* :class:`ShmTarget`: a shared-memory segment (``shm.create_segment``), one
  ``pwrite`` per block through the task's own descriptor;
* :class:`BufferTarget`: a writable byte range, here the payload of the
  serialized ``GenerateRequest`` (:func:`new_bytes`), so the request that
  grpc sends is the buffer the rows were computed into; where the values
  travel unconverted its writer is a :class:`~mmgate.types.RowArray` and the
  compiled row writers compute straight into the payload (no block copy).

:func:`new_bytes` allocates a ``bytes`` object with uninitialized contents
(CPython ``PyBytes_FromStringAndSize(NULL, n)``, the documented C-API way to
build a bytes object in place) and returns a writable numpy view of it: grpc's
Python API takes only ``bytes``, and this avoids a full copy of a payload that
is tens of megabytes.  The bytes object is written only before it is handed
to anyone (never hashed, never shared while being written).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mmgate.transport import shm
from mmgate.types import RowArray, RowWrite

#: converts one float32/uint8 block to its wire representation (identity for float32 and uint8)
Convert = Callable[[np.ndarray], np.ndarray]

_PyBytes_FromStringAndSize = ctypes.pythonapi.PyBytes_FromStringAndSize
_PyBytes_FromStringAndSize.restype = ctypes.py_object
_PyBytes_FromStringAndSize.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_PyBytes_AsString = ctypes.pythonapi.PyBytes_AsString
_PyBytes_AsString.restype = ctypes.c_void_p
_PyBytes_AsString.argtypes = (ctypes.py_object,)


def new_bytes(nbytes: int) -> tuple[bytes, np.ndarray]:
    """A new ``bytes`` of ``nbytes`` uninitialized bytes and a writable uint8 view ``[nbytes]`` of them.

    The caller keeps the bytes object alive while it uses the view, fills every
    byte, and hands the bytes on only when done.
    """
    data: bytes = _PyBytes_FromStringAndSize(None, nbytes)
    if nbytes == 0:
        return data, np.zeros(0, dtype=np.uint8)
    address = _PyBytes_AsString(data)
    view = np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(address))
    return data, view


_MADV_DONTNEED = 4  # linux/mman.h
_PAGE = mmap.PAGESIZE
_madvise: Any = None  # no madvise in this C library: nothing is released
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
    _madvise.restype = ctypes.c_int
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (OSError, AttributeError):
    pass


def release_pages(data: bytes) -> int:
    """Give the memory pages wholly inside ``data``'s buffer back to the system (``madvise(MADV_DONTNEED)``).

    For a bytes object nobody reads again (a request grpc has already copied for sending,
    :meth:`mmgate.engines.client.WorkerClient.generate`): the whole pages inside it then read as zeros
    (private anonymous memory on Linux), while the object stays valid and is freed as usual.  Only whole
    pages from 64 bytes past the start are released: the object's header and the allocator's chunk
    headers (before the buffer, after its end) are never touched.  A buffer of at least glibc's largest
    mmap threshold (32 MiB) is usually a mapping of its own (unless a free heap chunk served it), so the
    release costs no page faults later; a smaller one is heap memory whose pages fault in again when
    reused.

    Returns:
        The bytes released (0 off Linux, where ``madvise`` is unavailable, or where it fails).
    """
    if _madvise is None or not data or not sys.platform.startswith("linux"):
        return 0
    address = _PyBytes_AsString(data)
    start = -(-(address + 64) // _PAGE) * _PAGE
    end = (address + len(data)) // _PAGE * _PAGE
    if end <= start or _madvise(start, end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start


def identity(block: np.ndarray) -> np.ndarray:
    """The block as it is (float32 or uint8 on the wire)."""
    return block


class BufferTarget:
    """Rows ``[rows, width]`` of ``itemsize``-byte values stored in a writable uint8 range ``view``.

    ``values``: the values' dtype (float32 normalized, uint8 raw) where they travel as they are
    (``convert`` is :func:`identity` and ``itemsize`` is the dtype's): :meth:`writer` then offers
    the rows themselves to compute into.  ``owner`` keeps the memory behind ``view`` alive.
    """

    def __init__(self, view: np.ndarray, width: int, itemsize: int, convert: Convert = identity,
                 owner: object = None, values: np.dtype | None = None) -> None:
        self._view = view
        self._row_bytes = width * itemsize
        self._convert = convert
        self._owner = owner
        direct = (values is not None and convert is identity and np.dtype(values).itemsize == itemsize
                  and self._row_bytes > 0 and view.size % self._row_bytes == 0)
        self._values = np.dtype(values) if direct else None

    @contextmanager
    def writer(self) -> Iterator[RowWrite]:
        """A writer of rows: a :class:`~mmgate.types.RowArray` over the view (``[rows, width]`` of
        ``values``) where the values travel unconverted, so a row writer may compute straight into it;
        otherwise a function converting each block and copying it in."""
        if self._values is not None:
            yield RowArray(self._view.view(self._values).reshape(-1, self._row_bytes // self._values.itemsize),
                           owner=self._owner)
            return

        def write(first_row: int, rows: np.ndarray) -> None:
            raw = np.ascontiguousarray(self._convert(rows)).reshape(-1).view(np.uint8)
            start = first_row * self._row_bytes
            self._view[start:start + raw.size] = raw

        yield write


class ShmTarget:
    """Rows ``[rows, width]`` of ``itemsize``-byte values stored in the shared-memory segment ``name``."""

    def __init__(self, name: str, width: int, itemsize: int, convert: Convert = identity) -> None:
        self.name = name
        self._row_bytes = width * itemsize
        self._convert = convert

    @contextmanager
    def writer(self) -> Iterator[RowWrite]:
        with shm.SegmentWriter(self.name) as segment:
            def write(first_row: int, rows: np.ndarray) -> None:
                segment.write(first_row * self._row_bytes, self._convert(rows))

            yield write
