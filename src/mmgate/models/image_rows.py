"""One image -> its ``pixel_values`` rows, normalized and patchified in one pass over cache-sized blocks.

Stage: preprocess (images).  In: resized uint8 ``[H, W, C]`` pixels; out: rows
``[gh*gw, C*T*p*p]`` (float32 normalized, uint8 raw, or a wire dtype) written
block by block into a destination: an array, or a transport sink (a shared-memory
segment, see :mod:`mmgate.transport.placement`), or computed straight into the
request bytes (a :class:`~mmgate.types.RowArray`), so the full-size float32 tensor
is written once and never copied.

The values are the reference's (transformers 5.24 ``Qwen2VLImageProcessor``
torchvision backend: ``rescale_and_normalize`` then ``patchify``;
``Qwen2VLImageProcessorPil``: ``rescale``, ``normalize``, ``patchify``); only the
order differs: patchify the **uint8** image first (a quarter of the bytes; the
layout permutation moves bytes, it does not change them), then normalize each
block of rows and repeat it along T.

Exactness of the normalization: the decoded image is uint8, so rescale +
normalize is a function of (channel, byte value) alone, tabulated by
:func:`mmgate.models.geometry.normalize_lut` with the reference's own
arithmetic.  :class:`RowNormalizer` picks a vectorized float32 formula only if
it reproduces that ``[C, 256]`` table bit for bit on **every** entry (an
exhaustive check over the whole input domain, done once per configuration), and
gathers the table otherwise.

Two implementations of :func:`write_rows` / :func:`image_rows`: the compiled kernel of
:mod:`mmgate.models.patch_native` (``mmgate._native.patchrows``: patchify, gather through
the ``[C, 256]`` table and repeat along T in one pass, straight into the block buffer or the
output array, without the GIL), used when it is built, and the numpy path (patchify the
uint8 image, normalize each block, repeat along T), its fallback (logged once).  Both give
the same bits: the table is the normalizer's definition and the formula equals it on every
input; ``tests/models/test_patch_rows_native.py`` compares them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from mmgate.models import patch_native
from mmgate.types import RowArray

#: rows per block: ``64 * C*T*p*p * 4`` bytes (393 KB for Qwen3-VL float32) stays in L2
BLOCK_ROWS = 64

#: ``sink(first_row, rows)``: receives each finished block ``[b, C*T*p*p]`` (a reused buffer: copy it); a
#: :class:`~mmgate.types.RowArray` sink gets the rows computed straight into it instead (no blocks)
RowSink = Callable[[int, np.ndarray], None]


@dataclass(frozen=True, slots=True)
class RowNormalizer:
    """uint8 -> float32 rescale + normalize of one configuration, equal to its ``[C, 256]`` table.

    ``formula``: ``(pre, scale, sub, div)`` for ``((x pre scale) - sub[c]) / div[c]`` in float32
    (``pre`` is ``"*"``, ``"/"`` or ``""`` for none), or None: gather ``lut``.
    """

    lut: npt.NDArray[np.float32]
    formula: tuple[str, np.float32, npt.NDArray[np.float32], npt.NDArray[np.float32]] | None

    @classmethod
    def for_table(cls, lut: npt.NDArray[np.float32], rescale_factor: float, mean: tuple[float, ...],
                  std: tuple[float, ...], do_rescale: bool, do_normalize: bool) -> RowNormalizer:
        """The fastest formula whose output equals ``lut`` on all ``C x 256`` inputs (else the table).

        Candidates: the torchvision backend's fused ``(x - mean/scale) / (std/scale)``
        (``TorchvisionBackend.rescale_and_normalize``), and ``((x * scale) - mean) / std``
        with the rescale as a float32 multiply or divide (the PIL backend rescales in
        float64; the check decides whether float32 gives the same values).
        """
        channels = lut.shape[0]
        mean_f = np.asarray(mean if do_normalize else (0.0,) * channels, dtype=np.float32)
        std_f = np.asarray(std if do_normalize else (1.0,) * channels, dtype=np.float32)
        candidates: list[tuple[str, np.float32, npt.NDArray[np.float32], npt.NDArray[np.float32]]] = []
        if do_rescale:
            inv = np.float32(1.0 / rescale_factor)
            candidates.append(("", np.float32(1), mean_f * inv, std_f * inv))
            candidates.append(("*", np.float32(rescale_factor), mean_f, std_f))
            candidates.append(("/", inv, mean_f, std_f))
        else:
            candidates.append(("", np.float32(1), mean_f, std_f))
        domain = np.broadcast_to(np.arange(256, dtype=np.uint8), (1, channels, 256))
        for formula in candidates:
            got = np.empty((1, channels, 256), dtype=np.float32)
            _apply_formula(domain, got, formula)
            if np.array_equal(got[0].view(np.uint32), lut.view(np.uint32)):
                return cls(lut=lut, formula=formula)
        return cls(lut=lut, formula=None)

    def __call__(self, src: npt.NDArray[np.uint8], out: npt.NDArray[np.float32]) -> None:
        """``out[b, c, k] = table[c, src[b, c, k]]`` for uint8 ``src`` ``[b, C, K]`` (``out`` may be strided)."""
        if self.formula is not None:
            _apply_formula(src, out, self.formula)
            return
        for c in range(self.lut.shape[0]):
            np.take(self.lut[c], src[:, c], out=out[:, c], mode="clip")


def _apply_formula(src: np.ndarray, out: np.ndarray,
                   formula: tuple[str, np.float32, npt.NDArray[np.float32], npt.NDArray[np.float32]]) -> None:
    pre, scale, sub, div = formula
    out[...] = src  # uint8 -> float32, exact
    if pre == "*":
        np.multiply(out, scale, out=out)
    elif pre == "/":
        np.divide(out, scale, out=out)
    np.subtract(out, sub.reshape(1, -1, 1), out=out)
    np.divide(out, div.reshape(1, -1, 1), out=out)


def patch_rows_u8(image: npt.NDArray[np.uint8], patch_size: int, merge_size: int) -> npt.NDArray[np.uint8]:
    """uint8 ``[H, W, C]`` -> ``[gh*gw, C, p*p]`` in the reference's patch order (no temporal repeat).

    The ``(gh/m, gw/m, m_h, m_w, C, p_h, p_w)`` order of transformers 5.24
    ``Qwen2VLImageProcessor.patchify`` without its T axis.
    """
    height, width, channels = image.shape
    gh, gw, m, p = height // patch_size, width // patch_size, merge_size, patch_size
    x = image.reshape(gh // m, m, p, gw // m, m, p, channels).transpose(0, 3, 1, 4, 6, 2, 5)
    return np.ascontiguousarray(x).reshape(gh * gw, channels, p * p)


def write_rows(image: npt.NDArray[np.uint8], patch_size: int, merge_size: int, temporal_patch_size: int,
               normalizer: RowNormalizer | None, sink: RowSink, block_rows: int = BLOCK_ROWS,
               band: tuple[int, int] = (0, 1), native: bool = True) -> int:
    """Patchify + normalize ``image`` and hand its rows to ``sink`` block by block; returns the row count.

    Rows are ``[C, T, p, p]`` flattened, each patch repeated ``temporal_patch_size``
    times along T (transformers 5.24 ``Qwen2VLImageProcessor.patchify`` of a single
    image).  ``normalizer`` None: raw uint8 values (``mm_device_do_normalize``).

    ``band=(k, n)``: only the k-th of n horizontal bands (whole rows of merged
    patches, whose output rows are contiguous), so n tasks can write one image
    in parallel; ``sink`` still receives image-wide row numbers.

    ``native`` False: the numpy path even where the compiled kernel is built (the same values).

    A :class:`~mmgate.types.RowArray` ``sink`` of the rows' dtype: with the compiled kernel the band's
    rows are computed straight into it (no blocks, ``block_rows`` unused); the numpy path still hands it
    blocks.

    Raises:
        ValueError: a ``RowArray`` holding fewer rows than the band writes.
    """
    k, parts = band
    unit = patch_size * merge_size
    merged_rows = image.shape[0] // unit
    r0, r1 = merged_rows * k // parts, merged_rows * (k + 1) // parts
    offset = r0 * merge_size * (image.shape[1] // patch_size)
    part = image[r0 * unit:r1 * unit]
    if native and patch_native.NATIVE:
        return _write_rows_native(part, patch_size, merge_size, temporal_patch_size, normalizer, sink, block_rows,
                                  offset)
    if native:
        patch_native.warn_fallback()
    src = patch_rows_u8(part, patch_size, merge_size)
    n, channels, area = src.shape
    t = temporal_patch_size
    dtype = np.dtype(np.uint8) if normalizer is None else np.dtype(np.float32)
    buf = np.empty((min(block_rows, n), channels, t, area), dtype=dtype)
    # Normalize into a contiguous scratch block (strided float ufuncs are ~2x slower), then repeat along T.
    scratch = np.empty((min(block_rows, n), channels, area), dtype=np.float32) if normalizer is not None else None
    for start in range(0, n, block_rows):
        stop = min(start + block_rows, n)
        block = buf[:stop - start]
        if normalizer is None or scratch is None:
            values: np.ndarray = src[start:stop]
        else:
            values = scratch[:stop - start]
            normalizer(src[start:stop], values)
        for k in range(t):
            block[:, :, k] = values
        sink(offset + start, block.reshape(stop - start, channels * t * area))
    return n


def _write_rows_native(part: npt.NDArray[np.uint8], patch_size: int, merge_size: int, temporal_patch_size: int,
                       normalizer: RowNormalizer | None, sink: RowSink, block_rows: int, offset: int) -> int:
    """:func:`write_rows` of the band ``part`` with the compiled kernel: straight into the destination
    when ``sink`` is a :class:`~mmgate.types.RowArray` (the request bytes), else block by block into one
    reused buffer handed to ``sink``.

    The direct write saves the copy of every block; docs/performance.md ("rows computed in place, large
    requests held once") has the measurements (``benchmarks/patch_rows.py --sink``, and end to end).
    """
    if isinstance(sink, RowArray) and sink.array.dtype == (np.uint8 if normalizer is None else np.float32):
        rows = patch_native.row_count(part.shape, patch_size, temporal_patch_size)
        dest = sink.rows(offset, rows)  # raises where the destination holds fewer rows
        if rows:
            patch_native.fill_rows(part, patch_size, merge_size, temporal_patch_size,
                                   None if normalizer is None else normalizer.lut, dest)
        return rows
    n = 0  # a band with no merged-patch row (more bands than rows) has none
    for start, block in patch_native.blocks(part, patch_size, merge_size, temporal_patch_size,
                                            None if normalizer is None else normalizer.lut, block_rows):
        sink(offset + start, block)
        n = start + len(block)
    return n


def image_rows(image: npt.NDArray[np.uint8], patch_size: int, merge_size: int, temporal_patch_size: int,
               normalizer: RowNormalizer | None, native: bool = True) -> np.ndarray:
    """:func:`write_rows` into a new array ``[gh*gw, C*T*p*p]`` (float32, or uint8 when ``normalizer`` is None).

    With the compiled kernel (``native`` and built), written in one call straight into the array.
    """
    height, width, channels = image.shape
    n = (height // patch_size) * (width // patch_size)
    out = np.empty((n, channels * temporal_patch_size * patch_size * patch_size),
                   dtype=np.uint8 if normalizer is None else np.float32)
    if native and patch_native.NATIVE and n:
        patch_native.fill_rows(image, patch_size, merge_size, temporal_patch_size,
                               None if normalizer is None else normalizer.lut, out)
        return out

    def into(start: int, rows: np.ndarray) -> None:
        out[start:start + len(rows)] = rows

    write_rows(image, patch_size, merge_size, temporal_patch_size, normalizer, into, native=native)
    return out
