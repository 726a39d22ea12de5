"""Qwen-VL ``pixel_values`` rows from uint8 frames in one compiled pass (optional), with argument checks.

Stage: preprocess (images, video frames).  In: uint8 frames ``[H, W, C]`` (an image, or a
band of whole merged-patch rows of one) or ``[N, H, W, C]`` (a clip); out: rows
``[rows, C*T*p*p]`` written into a caller-provided array, in the order of transformers 5.24
``Qwen2VLImageProcessor.patchify`` (one image: each patch repeated T times along T) and
``Qwen2VLVideoProcessor.patchify`` (a clip: frame ``g*T + t`` of temporal group g, the last
frame repeated to pad the clip to a multiple of T): row ``(g, gh/m, gw/m, m_h, m_w)``,
column ``(C, T, p_h, p_w)``.

The values are float32 ``lut[c, byte]`` for the ``[C, 256]`` table of a
:class:`~mmgate.models.image_rows.RowNormalizer` (``RowNormalizer.lut``, the configuration's
rescale + normalize tabulated with the reference's arithmetic), or the bytes themselves
(``lut`` None: ``mm_device_do_normalize``).  Both are copies (a gather through the table, a
byte permutation): no arithmetic, so the rows equal the numpy path's
(:func:`mmgate.models.image_rows.patch_rows_u8` + ``RowNormalizer``) bit for bit whichever
formula the normalizer would pick, and whatever flags the C compiler used.

The kernel is ``mmgate._native.patchrows`` (``src/mmgate/_native/patchrows.c``, built by
``pip install`` as an optional extension, like ``tvresize``); it releases the GIL while it
writes, so the bands of an image written from several pool threads run in parallel.  Where it
is not built, :data:`NATIVE` is False, :func:`fill_rows` raises, and the callers
(:func:`mmgate.models.image_rows.write_rows`) run their numpy path, logging that once
(:func:`warn_fallback`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

try:  # the compiled kernel (setup.py builds it); absent: the numpy path of image_rows
    from mmgate._native import patchrows as _native
except ImportError:  # not built (no compiler at install time, or a source checkout)
    _native = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: whether ``mmgate._native.patchrows`` is built (:func:`fill_rows` runs)
NATIVE: bool = _native is not None


def row_count(frames_shape: tuple[int, ...], patch_size: int, temporal_patch_size: int) -> int:
    """Rows of ``[H, W, C]`` / ``[N, H, W, C]`` frames: ``ceil(N / T) * (H/p) * (W/p)`` (N = 1 for an image)."""
    n = frames_shape[0] if len(frames_shape) == 4 else 1
    height, width = frames_shape[-3:-1]
    return -(-n // temporal_patch_size) * (height // patch_size) * (width // patch_size)


def fill_rows(frames: npt.NDArray[np.uint8], patch_size: int, merge_size: int, temporal_patch_size: int,
              lut: npt.NDArray[np.float32] | None, out: np.ndarray, first_row: int = 0) -> None:
    """Write rows ``first_row .. first_row + len(out)`` of ``frames``' patch rows into ``out``.

    Args:
        frames: uint8 ``[H, W, C]`` or ``[N, H, W, C]``, H and W multiples of ``patch_size *
            merge_size`` (any strides: a non-contiguous array is copied first).
        lut: float32 ``[C, 256]`` (``RowNormalizer.lut``), or None for the raw bytes.
        out: C-contiguous, writable ``[rows, C*T*p*p]``, float32 with ``lut``, uint8 without; any
            byte address (a float32 view of a serialized request's payload need not be aligned).

    Raises:
        RuntimeError: the extension is not built.
        TypeError: a dtype other than those above.
        ValueError: a shape that does not fit (sizes, row range, ``out`` width, ``lut`` shape),
            a non-contiguous or read-only ``out``.
    """
    if _native is None:
        raise RuntimeError("mmgate._native.patchrows is not built")
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
        raise TypeError(f"frames must be a uint8 array, got {getattr(frames, 'dtype', type(frames))}")
    if frames.ndim not in (3, 4):
        raise ValueError(f"frames must be [H, W, C] or [N, H, W, C], got shape {frames.shape}")
    n = frames.shape[0] if frames.ndim == 4 else 1
    height, width, channels = frames.shape[-3:]
    p, m, t = patch_size, merge_size, temporal_patch_size
    if min(p, m, t, n, height, width, channels) < 1 or height % (p * m) or width % (p * m):
        raise ValueError(f"frames {frames.shape} are not whole merged patches of {p * m} pixels "
                         f"(patch {p}, merge {m}, temporal {t})")
    want = np.dtype(np.uint8) if lut is None else np.dtype(np.float32)
    if not isinstance(out, np.ndarray) or out.dtype != want:
        raise TypeError(f"out must be a {want} array, got {getattr(out, 'dtype', type(out))}")
    row_width = channels * t * p * p
    if out.ndim != 2 or out.shape[1] != row_width:
        raise ValueError(f"out must be [rows, {row_width}], got shape {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be C-contiguous and writable")
    total = row_count(frames.shape, p, t)
    if not 0 <= first_row <= total - out.shape[0]:
        raise ValueError(f"rows [{first_row}, {first_row + out.shape[0]}) outside the {total} rows of the frames")
    if lut is not None:
        if not isinstance(lut, np.ndarray) or lut.dtype != np.float32:
            raise TypeError(f"lut must be a float32 array, got {getattr(lut, 'dtype', type(lut))}")
        if lut.shape != (channels, 256):
            raise ValueError(f"lut must be [{channels}, 256], got shape {lut.shape}")
        lut = np.ascontiguousarray(lut)
    _native.patch_rows(np.ascontiguousarray(frames), out, lut, n, height, width, channels, p, m, t,
                       first_row, out.shape[0])


def blocks(frames: npt.NDArray[np.uint8], patch_size: int, merge_size: int, temporal_patch_size: int,
           lut: npt.NDArray[np.float32] | None, block_rows: int) -> Iterator[tuple[int, np.ndarray]]:
    """Every row of ``frames`` as ``(first_row, rows)`` blocks of up to ``block_rows`` rows, all written
    into one reused buffer (the consumer copies each block before asking for the next).

    The arguments are checked once, as :func:`fill_rows` checks them (same exceptions), then each
    block is one call of the kernel.
    """
    if not isinstance(frames, np.ndarray) or frames.ndim not in (3, 4):
        raise ValueError(f"frames must be [H, W, C] or [N, H, W, C], got shape {np.shape(frames)}")
    frames = np.ascontiguousarray(frames)
    total = row_count(frames.shape, patch_size, temporal_patch_size)
    width = frames.shape[-1] * temporal_patch_size * patch_size * patch_size
    buf = np.empty((max(1, min(block_rows, total)), width), dtype=np.uint8 if lut is None else np.float32)
    if lut is not None:
        lut = np.ascontiguousarray(lut)
    n = frames.shape[0] if frames.ndim == 4 else 1
    height, width_px, channels = frames.shape[-3:]
    for start in range(0, total, block_rows):
        block = buf[:min(block_rows, total - start)]
        if start == 0:
            fill_rows(frames, patch_size, merge_size, temporal_patch_size, lut, block)
        else:
            assert _native is not None
            _native.patch_rows(frames, block, lut, n, height, width_px, channels, patch_size, merge_size,
                               temporal_patch_size, start, len(block))
        yield start, block


_fallback_logged = threading.Event()


def warn_fallback() -> None:
    """Log once per process that the numpy path writes the rows (the extension is not built)."""
    if not _fallback_logged.is_set():
        _fallback_logged.set()
        logger.warning("mmgate._native.patchrows is not built (reinstall mmgate with a C compiler): Qwen-VL "
                       "patch rows run their numpy path, exact but about 1.5-3x slower")
