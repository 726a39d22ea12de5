"""Pixel work of a Qwen-VL clip: resize the frames, patchify, rescale + normalize.

Stage: preprocess (video).  In: uint8 frames ``[N, H, W, C]``; out: rows
``[grid_t*grid_h*grid_w, C*T*P*P]`` of ``pixel_values``, float32 (or uint8 raw).

The reference (transformers 5.24 ``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor``
``_preprocess``) resizes a ``[1, N, C, H, W]`` uint8 tensor with ``tvF.resize``
(bicubic, antialias), applies the fused rescale+normalize in float32
(``TorchvisionBackend.rescale_and_normalize``: ``(x - mean/scale) / (std/scale)``),
pads time with copies of the last frame and patchifies with a view + permute.
Here the same values come in a cheaper order, without torch: resize each
channels-last frame with :func:`mmgate.models.geometry.resize_uint8` (torchvision
backend: :mod:`mmgate.media.tv_resize`, torch's uint8 kernel bit for bit; torch
loops over the batch, so frame by frame is the same bytes), patchify the **uint8**
frames (a quarter of the bytes; the permutation moves bytes, it does not change
them), then normalize the rows with :class:`mmgate.models.image_rows.RowNormalizer`
for the ``[C, 256]`` table of ``geometry.normalize_lut`` (torchvision branch): the
fused float32 formula where it equals the table on every input (checked once
per configuration; it is the reference's own IEEE float32 ``sub`` / ``div``), else
a gather of the table.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from mmgate.models import geometry, patch_native
from mmgate.models.image_rows import BLOCK_ROWS, RowNormalizer, RowSink
from mmgate.models.backend import ImageBackend
from mmgate.types import RowArray

#: (gt, T, gh/m, m_h, p_h, gw/m, m_w, p_w, C) -> (gt, gh/m, gw/m, m_h, m_w, C, T, p_h, p_w): the reference's
#: ``permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)`` of ``(B, gt, T, C, gh/m, m, p, gw/m, m, p)``, from channels-last
PATCH_AXES = (0, 2, 5, 3, 6, 8, 1, 4, 7)


def patchify_video(values: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """``[N, H, W, C]`` frames -> ``[grid_t*gh*gw, C*T*p*p]`` rows (any dtype), time padded with the last frame.

    Port of transformers 5.24 ``Qwen2VLVideoProcessor.patchify`` (same in Qwen3-VL).
    """
    if pad := -values.shape[0] % temporal_patch_size:
        values = np.concatenate([values, np.repeat(values[-1:], pad, axis=0)], axis=0)
    n, height, width, channels = values.shape
    gt, gh, gw = n // temporal_patch_size, height // patch_size, width // patch_size
    m, p, t = merge_size, patch_size, temporal_patch_size
    x = values.reshape(gt, t, gh // m, m, p, gw // m, m, p, channels).transpose(PATCH_AXES)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, channels * t * p * p)


def normalize_rows(rows: np.ndarray, normalizer: RowNormalizer, block_rows: int = BLOCK_ROWS) -> np.ndarray:
    """uint8 ``[P, C*T*p*p]`` rows -> float32 ``[P, C*T*p*p]`` through ``normalizer``, in blocks of rows
    (so the float32 temporaries of the formula stay in cache)."""
    channels = normalizer.lut.shape[0]
    src = rows.reshape(rows.shape[0], channels, -1)
    out = np.empty(src.shape, dtype=np.float32)
    for start in range(0, src.shape[0], block_rows):
        normalizer(src[start:start + block_rows], out[start:start + block_rows])
    return out.reshape(rows.shape)


class FrameProcessor:
    """Resize + patchify + normalize for one set of video parameters (no torch: see the module doc).

    ``normalizer``: the exact uint8 -> float32 rescale + normalize (the reference's fused
    formula where it equals ``lut`` on every input, else a gather of ``lut``).
    """

    def __init__(self, backend: ImageBackend, lut: np.ndarray, rescale_factor: float, mean: tuple[float, ...],
                 std: tuple[float, ...], do_rescale: bool, do_normalize: bool) -> None:
        self.backend = backend
        self.lut = lut
        self.normalizer = RowNormalizer.for_table(lut, rescale_factor, mean, std, do_rescale, do_normalize)

    def __call__(self, frames: np.ndarray, size_hw: tuple[int, int] | None, resample: int, patch_size: int,
                 merge_size: int, temporal_patch_size: int, raw: bool) -> np.ndarray:
        """uint8 ``[N, H, W, C]`` -> rows; ``size_hw`` None: no resize.  Each temporal patch's frames are
        resized and written straight into their rows of the result (at most ``temporal_patch_size``
        resized frames held at a time)."""
        height, width = size_hw if size_hw is not None else frames.shape[1:3]
        per_group = (height // patch_size) * (width // patch_size)
        groups = -(-frames.shape[0] // temporal_patch_size)
        out = np.empty((groups * per_group, frames.shape[3] * temporal_patch_size * patch_size * patch_size),
                       dtype=np.uint8 if raw else np.float32)
        for g, part in self._groups(frames, size_hw, resample, temporal_patch_size):
            self._rows(part, patch_size, merge_size, temporal_patch_size, raw, out[g * per_group:(g + 1) * per_group])
        return out

    def write_rows(self, frames: np.ndarray, size_hw: tuple[int, int] | None, resample: int, patch_size: int,
                   merge_size: int, temporal_patch_size: int, raw: bool, sink: RowSink) -> int:
        """:meth:`__call__`'s rows handed to ``sink(first_row, rows)`` one temporal patch at a time
        (one block of ``grid_h * grid_w`` rows, reused); returns the rows written.  A
        :class:`~mmgate.types.RowArray` sink of the rows' dtype gets each temporal patch's rows written
        straight into it (no block buffer, no block copy; ``ValueError`` where it holds too few rows)."""
        height, width = size_hw if size_hw is not None else frames.shape[1:3]
        per_group = (height // patch_size) * (width // patch_size)
        dtype = np.dtype(np.uint8 if raw else np.float32)
        direct = sink if isinstance(sink, RowArray) and sink.array.dtype == dtype else None
        block = None if direct is not None else np.empty(
            (per_group, frames.shape[3] * temporal_patch_size * patch_size * patch_size), dtype=dtype)
        written = 0
        for g, part in self._groups(frames, size_hw, resample, temporal_patch_size):
            if direct is not None:
                dest = direct.rows(g * per_group, per_group)  # raises where the sink holds too few rows
                self._rows(part, patch_size, merge_size, temporal_patch_size, raw, dest)
            else:
                assert block is not None
                self._rows(part, patch_size, merge_size, temporal_patch_size, raw, block)
                sink(g * per_group, block)
            written += per_group
        return written

    def _groups(self, frames: np.ndarray, size_hw: tuple[int, int] | None, resample: int,
                temporal_patch_size: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(g, frames of temporal patch g)``, resized into one reused buffer; the last patch may hold
        fewer frames (the row writer pads it with its last frame, the clip's last, as the reference)."""
        buf = None
        if size_hw is not None and tuple(size_hw) != frames.shape[1:3]:
            buf = np.empty((temporal_patch_size, size_hw[0], size_hw[1], frames.shape[3]), dtype=np.uint8)
        for g, start in enumerate(range(0, frames.shape[0], temporal_patch_size)):
            part = frames[start:start + temporal_patch_size]
            if buf is not None:
                assert size_hw is not None
                for j, frame in enumerate(part):
                    buf[j] = geometry.resize_uint8(frame, size_hw, resample, self.backend)
                part = buf[:len(part)]
            yield g, part

    def _rows(self, frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int, raw: bool,
              out: np.ndarray) -> None:
        """The rows of one temporal patch's frames into ``out`` (C-contiguous ``[grid_h*grid_w, width]``)."""
        if patch_native.NATIVE:  # pad, patchify and normalize in one compiled pass (the same values)
            patch_native.fill_rows(frames, patch_size, merge_size, temporal_patch_size,
                                   None if raw else self.normalizer.lut, out)
            return
        rows = patchify_video(frames, patch_size, merge_size, temporal_patch_size)
        out[...] = rows if raw else normalize_rows(rows, self.normalizer)
