"""torch's CPU uint8 antialiased bilinear / bicubic resize, bit for bit, without torch.

Stage: resize (torchvision image backend).  In: a uint8 ``[H, W, C]`` image; out:
the uint8 ``[h, w, C]`` array that torchvision 0.29.1
``transforms.v2.functional.resize(uint8 [C, H, W], [h, w], BILINEAR | BICUBIC,
antialias=True)`` returns on CPU with torch 2.14.1 (``permute``-d back to HWC).

Two implementations of the same integer arithmetic, both tested against torch
(``tests/media/test_tv_resize.py``): the compiled passes of
``mmgate._native.tvresize`` (``src/mmgate/_native/tvresize.c``, built by
``pip install``; AVX2 kernels where the CPU has AVX2, portable C elsewhere), which
:func:`resize_uint8_tv` uses, and a numpy port (:func:`resize_uint8_tv_numpy`),
its fallback when the extension is not built (logged once).  The weights are
computed here, in float64, for both.

What that call runs, and what this module mirrors:

* torchvision ``_geometry.resize_image``: returns the input untouched when
  ``(h, w) == (H, W)``; else keeps uint8 when ``_do_native_uint8_resize_on_cpu``
  (BICUBIC always; BILINEAR when the CPU capability is AVX2 / AVX512 or on arm64)
  and calls ``F.interpolate(..., align_corners=False, antialias=True)`` ->
  ``torch._C._nn._upsample_bicubic2d_aa`` / ``_upsample_bilinear2d_aa``, with the
  output size only (no scale factors).  On a non-AVX x86 CPU BILINEAR instead goes
  through float32 and ``round_``; that variant is *not* what this module computes.
* ATen ``native/cpu/UpSampleKernel.cpp`` ``upsample_bicubic2d_aa_kernel_impl``
  (and the bilinear twin): uint8 with ``C <= 4`` on an AVX2 build runs
  ``upsample_avx_bilinear_bicubic_uint8`` (``UpSampleKernelAVXAntialias.h``);
  otherwise ``separable_upsample_generic_Nd_kernel_impl`` with
  ``basic_loop_aa_horizontal<uint8_t>`` / ``basic_loop_aa_vertical<uint8_t>``.
  Both use the same int16 weights and the same integer formula (the AVX kernel
  accumulates ``madd_epi16`` products in int32 and saturates with
  ``packs_epi32`` / ``packus_epi16``, which is the generic ``std::clamp``).  They
  differ in one place, measured with ``ATEN_CPU_CAPABILITY=default`` and with
  C = 5: the generic path returns wrong bytes when ``w == 1`` (every output row
  the same).  This module follows the AVX kernel, which is what x86 CPUs with
  AVX2 / AVX512 run for C <= 4; the tests compare with the torch installed here.
* Weights, per axis (``HelperInterpBase::_compute_indices_min_size_weights_aa``,
  ``_compute_index_ranges_weights``, ``_compute_index_ranges_int16_weights``),
  in float64: ``scale = in / out``; ``support = (interp_size / 2) * max(scale, 1)``
  (interp_size 2 bilinear, 4 bicubic); output ``i`` has
  ``center = scale * (i + 0.5)``, taps ``xmin = max(int(center - support + 0.5), 0)``,
  ``xsize = min(int(center + support + 0.5), in) - xmin`` clipped to
  ``[0, 2 * ceil(support) + 1]``, raw weights
  ``filter((j + xmin - center + 0.5) * (1 / scale if scale >= 1 else 1))`` with
  ``HelperInterpLinear::aa_filter`` (triangle) or ``HelperInterpCubic::aa_filter``
  (Keys cubic, a = -0.5), summed left to right and divided by their total when
  it is nonzero.  ``precision`` is the first p in 0..21 with
  ``int(0.5 + wt_max * 2**(p + 1)) >= 2**15`` (else 22), ``wt_max`` the largest
  normalised weight of the axis; int16 weights are ``trunc(w * 2**p +- 0.5)``.
* Passes: horizontal first (skipped when ``w == W``), into a uint8 intermediate,
  then vertical (skipped when ``h == H``); each output byte is
  ``clamp((sum(pixel * weight) + 2**(p - 1)) >> p, 0, 255)``.

How the numpy fallback computes it: a pass is a banded matrix product.  The outputs are cut
into blocks of ``block`` consecutive outputs; block k is a dense
``[block, span]`` matrix (the int16 weights times ``2**-p``, zeros elsewhere)
applied with ``np.matmul`` to the ``span`` input rows / columns its taps touch.
Pixels enter centred, ``v - 128`` in [-128, 127], and the
products are integers times ``2**-p`` of at most 23 significant bits, so while
``128 * max(sum|w|) + max|r| < 2**24`` every partial sum, in any order, is exact in
float32 (else the whole resize runs in float64, exact below 2**53); here
``r = 128 * (sum(w) - 2**p) + 2**(p - 1)`` folds the centring and torch's
``+ 2**(p - 1)`` into one per-output bias, and ``floor`` / clip / ``+ 128`` on the
exact scaled sum is torch's ``>> p`` and clamp.  This covers ``p <= 16``, i.e.
downscales up to about 4x.  The horizontal pass reads the image as
planes ``[C * H, W]`` (a transposed operand, so no explicit transpose) and writes
``[w, C * H]``; the vertical pass reads that (or the unchanged image) and writes
rows ``[h, w * C]``, which already are the HWC output.  Each product is kept
below OpenBLAS's threading threshold, so the whole resize runs on the calling
thread (as torch's kernel does) and never waits on a BLAS thread team.

Invariants: the result equals torch's byte for byte for every size (1x1, 1xN,
Nx1, up- and downscale) and 1..4 channels (more channels also follow the generic
path's formula); both paths run on the calling thread (the compiled one without
the GIL).  The numpy path needs a BLAS that computes float32 / float64 products
and sums in IEEE arithmetic (OpenBLAS, Accelerate and MKL do; a BLAS switched to
TF32 / bfloat16 arithmetic would not), and keeps float scratch planes of up to
:data:`SCRATCH_MAX_BYTES` per thread (re-faulting fresh pages costs about as much
as the arithmetic); larger ones are allocated per call.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

try:  # the compiled passes (setup.py builds them); absent: the numpy path of this module
    from mmgate._native import tvresize as _native
except ImportError:  # not built (no compiler at install time, or a source checkout)
    _native = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: the compiled kernel :func:`resize_uint8_tv` runs: "avx2", "c" (portable C), or None (numpy)
NATIVE_KERNEL: str | None = None if _native is None else _native.KERNEL

Mode = Literal["bilinear", "bicubic"]

#: torch ``HelperInterpLinear::interp_size`` / ``HelperInterpCubic::interp_size``
INTERP_SIZE: dict[str, int] = {"bilinear": 2, "bicubic": 4}
#: Keys cubic parameter of ``HelperInterpCubic::aa_filter<double, use_keys_cubic=true>``
CUBIC_A = -0.5
#: largest float scratch plane kept per thread between calls
SCRATCH_MAX_BYTES = 32 << 20
#: outputs per matrix product (a trade between call count and zero padding, measured)
_BLOCK = {"bilinear": 8, "bicubic": 8, "identity": 16}
#: output bytes post-processed at once, so that it happens in cache
_GROUP_BYTES = 1 << 20
#: float input columns converted at once for the horizontal pass
_COLUMN_BYTES = 4 << 20
#: multiply-adds per matrix product: OpenBLAS runs a product below 2 * 4 * 65536 (twice its
#: GEMM_MULTITHREAD_THRESHOLD * SMP_THRESHOLD_MIN) on the calling thread; hundreds of mid-sized
#: products handed to its thread team slow down tenfold or more on an oversubscribed CPU
_MAX_CALL_MACS = (1 << 19) - 1


@dataclass(frozen=True, slots=True)
class AxisWeights:
    """torch's fixed-point weights for resizing one axis of ``in_size`` to ``out_size``."""

    xmin: npt.NDArray[np.int64]  # [out] first input index read by each output
    xsize: npt.NDArray[np.int64]  # [out] number of taps of each output
    weights: npt.NDArray[np.int16]  # [out, max_interp_size] int16 weights, zero past xsize
    precision: int  # the result is (sum + 2**(precision - 1)) >> precision


def _aa_filter(x: npt.NDArray[np.float64], mode: str) -> npt.NDArray[np.float64]:
    """``HelperInterpLinear::aa_filter`` / ``HelperInterpCubic::aa_filter`` (float64)."""
    x = np.abs(x)
    if mode == "bilinear":
        return np.where(x < 1.0, 1.0 - x, 0.0)
    a = CUBIC_A
    # cubic_convolution1 / cubic_convolution2 of aten/src/ATen/native/UpSample.h, same operation order
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@lru_cache(maxsize=256)
def axis_weights(in_size: int, out_size: int, mode: Mode) -> AxisWeights:
    """Port of ``_compute_index_ranges_int16_weights`` (antialias=True, align_corners=False).

    Vectorised over the outputs; every float operation is the C++ one, in the same order
    (the per-output total is a sequential ``np.add.accumulate``, as the C loop adds).
    """
    interp_size = INTERP_SIZE[mode]
    scale = in_size / out_size  # area_pixel_compute_scale<double>, no scale factor given
    support = (interp_size * 0.5) * scale if scale >= 1.0 else interp_size * 0.5
    max_interp_size = math.ceil(support) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0

    i = np.arange(out_size, dtype=np.int64)
    center = scale * (i + 0.5)
    xmin = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    xsize = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin
    xsize = np.clip(xsize, 0, max_interp_size)

    j = np.arange(max_interp_size, dtype=np.int64)
    taps = (j[None, :] + xmin[:, None]).astype(np.float64)
    w = _aa_filter(((taps - center[:, None]) + 0.5) * invscale, mode)
    w[j[None, :] >= xsize[:, None]] = 0.0
    total = np.add.accumulate(w, axis=1)[:, -1]
    nonzero = total != 0.0
    w[nonzero] /= total[nonzero, None]
    wt_max = max(0.0, float(w[nonzero].max())) if nonzero.any() else 0.0

    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    v = w * (1 << precision)
    fixed = np.where(v < 0, np.trunc(-0.5 + v), np.trunc(0.5 + v)).astype(np.int64)
    return AxisWeights(xmin, xsize, fixed.astype(np.int16), precision)  # int -> int16_t wraps, as in C


@dataclass(frozen=True, slots=True)
class _PassPlan:
    """One axis pass as ``n`` dense matrix products over windows of the input axis."""

    block: int  # outputs per product (the last block is moved back to end at out_size)
    span: int  # input rows per window
    out_starts: tuple[int, ...]  # [n] first output of each block
    in_starts: tuple[int, ...]  # [n] first input row of each window
    mats64: npt.NDArray[np.float64]  # [n, block, span] int16 weights * 2**-precision
    mats32: npt.NDArray[np.float32]  # the same, exact in float32 too
    bias64: npt.NDArray[np.float64]  # [out, 1] r * 2**-precision: centring and torch's rounding half
    bias32: npt.NDArray[np.float32]  # the same (exact: r has few significant bits)
    fits_float32: bool  # every partial sum of the pass (on centred input) is exact in float32

    def mats(self, dtype: type[np.floating]) -> npt.NDArray[np.floating]:
        return self.mats32 if dtype is np.float32 else self.mats64

    def bias(self, dtype: type[np.floating]) -> npt.NDArray[np.floating]:
        return self.bias32 if dtype is np.float32 else self.bias64


@lru_cache(maxsize=128)
def _pass_plan(in_size: int, out_size: int, mode: str) -> _PassPlan:
    """Block the band of ``axis_weights`` (``mode="identity"``: the copy that a skipped pass is)."""
    if mode == "identity":
        xmin = np.arange(out_size, dtype=np.int64)
        xsize = np.ones(out_size, dtype=np.int64)
        weights = np.ones((out_size, 1), dtype=np.int64)
        precision = 0
    else:
        ax = axis_weights(in_size, out_size, mode)  # type: ignore[arg-type]
        xmin, xsize, weights, precision = ax.xmin, ax.xsize, ax.weights.astype(np.int64), ax.precision
    block = min(_BLOCK[mode], out_size)
    n = -(-out_size // block)
    out_starts = np.minimum(np.arange(n, dtype=np.int64) * block, out_size - block)
    rows = out_starts[:, None] + np.arange(block)  # [n, block] output index
    lo = xmin[rows].min(axis=1)
    span = int(max(1, ((xmin + xsize)[rows].max(axis=1) - lo).max()))
    in_starts = np.minimum(lo, in_size - span)

    mats = np.zeros((n, block, span))
    t = np.arange(weights.shape[1])
    k, r, tap = np.nonzero(t[None, None, :] < xsize[rows][:, :, None])
    col = xmin[rows[k, r]] - in_starts[k] + tap
    mats[k, r, col] = weights[rows[k, r], tap] * 2.0 ** -precision
    # sum(w * v) + 2**(p-1) == sum(w * (v - 128)) + r, in units of 2**-p; r is exact in float32
    r = 128 * (weights.sum(axis=1) - (1 << precision)) + 2.0 ** (precision - 1)
    bound = 128 * int(np.abs(weights).sum(axis=1).max()) + float(np.abs(r).max())
    bias = (r * 2.0 ** -precision)[:, None]
    mats32, bias32 = mats.astype(np.float32), bias.astype(np.float32)
    for arr in (mats, mats32, bias, bias32):
        arr.flags.writeable = False  # cached and shared between threads
    return _PassPlan(block, span, tuple(out_starts.tolist()), tuple(in_starts.tolist()),
                     mats, mats32, bias, bias32, bound < (1 << 24))


class _Scratch(threading.local):
    """Per-thread work arrays, reused while they are at most ``SCRATCH_MAX_BYTES``."""

    def __init__(self) -> None:
        self.buffers: dict[str, npt.NDArray[np.uint8]] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: type[np.generic]) -> npt.NDArray[Any]:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if nbytes > SCRATCH_MAX_BYTES:
            return np.empty(shape, dtype)
        buf = self.buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self.buffers[name] = np.empty(nbytes, np.uint8)
        return buf[:nbytes].view(dtype).reshape(shape)


_SCRATCH = _Scratch()


def _groups(plan: _PassPlan, row_bytes: int) -> list[tuple[int, int]]:
    """Consecutive block ranges whose output rows take about ``_GROUP_BYTES``."""
    step = max(1, _GROUP_BYTES // max(1, plan.block * row_bytes))
    n = len(plan.out_starts)
    return [(g, min(g + step, n)) for g in range(0, n, step)]


def _chunks(n: int, macs_per_item: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into equal ranges of at most ``_MAX_CALL_MACS // macs_per_item`` items."""
    count = -(-n * macs_per_item // _MAX_CALL_MACS)
    size = -(-n // count)
    return [(r, min(r + size, n)) for r in range(0, n, size)]


def _horizontal(plan: _PassPlan, pixels: npt.NDArray[np.uint8], out: npt.NDArray[np.floating]) -> None:
    """``out[w, C*H]`` = the horizontal pass of uint8 ``pixels[H, W, C]``, rounded, clamped, centred.

    The input columns of a group of blocks are turned into centred float planes ``[C*H, cols]``
    just before use, so that they are read from cache and never fill memory at full size.
    """
    height, _, channels = pixels.shape
    dtype = out.dtype.type
    mats, bias = plan.mats(dtype), plan.bias(dtype)
    span, block = plan.span, plan.block
    col_bytes = channels * height * out.itemsize
    chunks = _chunks(channels * height, block * span)
    step = max(1, min(len(plan.out_starts), (_COLUMN_BYTES // col_bytes) // max(1, span)))
    for g0 in range(0, len(plan.out_starts), step):
        g1 = min(g0 + step, len(plan.out_starts))
        a0, a1 = plan.in_starts[g0], plan.in_starts[g1 - 1] + span
        strip = _SCRATCH.get("strip", (height, a1 - a0, channels), np.uint8)
        np.copyto(strip, pixels[:, a0:a1])  # whole rows of bytes first: deinterleaving in cache is 3x faster
        planes = _SCRATCH.get("planes", (channels, height, a1 - a0), dtype)
        for c in range(channels):
            np.copyto(planes[c], strip[:, :, c])
        np.subtract(planes, 128, out=planes)
        flat = planes.reshape(channels * height, a1 - a0)
        for k in range(g0, g1):
            a, o = plan.in_starts[k] - a0, plan.out_starts[k]
            for r0, r1 in chunks:
                np.matmul(mats[k], flat[r0:r1, a:a + span].T, out=out[o:o + block, r0:r1])
        o0, o1 = plan.out_starts[g0], plan.out_starts[g1 - 1] + block
        seg = out[o0:o1]
        np.add(seg, bias[o0:o1], out=seg)
        np.floor(seg, out=seg)
        np.clip(seg, -128, 127, out=seg)  # the uint8 intermediate, centred


def _vertical(plan: _PassPlan, src: npt.NDArray[np.floating], transposed: bool,
              result: npt.NDArray[np.uint8]) -> None:
    """``result[h, w*C]`` = the vertical pass of ``src`` (``[H, w*C]``, or ``[w*C, H]`` if transposed)."""
    dtype = src.dtype.type
    mats, bias = plan.mats(dtype), plan.bias(dtype) + dtype(128)
    span, block = plan.span, plan.block
    groups = _groups(plan, result.shape[1] * src.itemsize)
    step = max(g1 - g0 for g0, g1 in groups)
    buf = _SCRATCH.get("rows", (step * block, result.shape[1]), dtype)
    chunks = _chunks(result.shape[1], block * span)
    for g0, g1 in groups:
        base = plan.out_starts[g0]
        for k in range(g0, g1):
            a, o = plan.in_starts[k], plan.out_starts[k] - base
            for r0, r1 in chunks:
                window = src[r0:r1, a:a + span].T if transposed else src[a:a + span, r0:r1]
                np.matmul(mats[k], window, out=buf[o:o + block, r0:r1])
        end = plan.out_starts[g1 - 1] + block
        seg = buf[:end - base]
        np.add(seg, bias[base:end], out=seg)  # exact while the value is in [0, 256)
        np.clip(seg, 0, 255, out=seg)
        np.copyto(result[base:end], seg, casting="unsafe")  # truncation == floor on [0, 255]


def _checked(pixels: npt.NDArray[np.uint8], size_hw: tuple[int, int], mode: str) -> tuple[int, int]:
    """The output ``(h, w)`` after validating the arguments (``ValueError`` otherwise)."""
    if mode not in INTERP_SIZE:
        raise ValueError(f"mode must be 'bilinear' or 'bicubic', got {mode!r}")
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or 0 in pixels.shape:
        raise ValueError(f"expected a non-empty uint8 [H, W, C] array, got {pixels.dtype} {pixels.shape}")
    h, w = (int(v) for v in size_hw)
    if h < 1 or w < 1:
        raise ValueError(f"output size must be positive, got {size_hw}")
    return h, w


def resize_uint8_tv(pixels: npt.NDArray[np.uint8], size_hw: tuple[int, int], mode: Mode) -> npt.NDArray[np.uint8]:
    """Resize uint8 ``[H, W, C]`` to ``[h, w, C]`` exactly as torch's CPU uint8 antialiased kernel.

    Runs the compiled passes (:func:`resize_uint8_tv_native`) when ``mmgate._native.tvresize``
    is built, else :func:`resize_uint8_tv_numpy` (the same bytes, 3-9x slower; logged once).

    Args:
        pixels: uint8 ``[H, W, C]`` (any strides; C = 1, 3 or 4 in practice).
        size_hw: ``(h, w)``, both >= 1.
        mode: ``"bilinear"`` or ``"bicubic"`` (torchvision ``InterpolationMode.BILINEAR`` /
            ``BICUBIC`` with ``antialias=True``).

    Returns:
        A new C-contiguous uint8 ``[h, w, C]``; a copy of ``pixels`` when the size is unchanged.
    """
    if _native is not None:
        return resize_uint8_tv_native(pixels, size_hw, mode)
    _warn_numpy_fallback()
    return resize_uint8_tv_numpy(pixels, size_hw, mode)


_fallback_logged = threading.Event()


def _warn_numpy_fallback() -> None:
    if not _fallback_logged.is_set():
        _fallback_logged.set()
        logger.warning("mmgate._native.tvresize is not built (reinstall mmgate with a C compiler): the "
                       "torchvision-backend resize runs its numpy fallback, exact but 3-9x slower")


@lru_cache(maxsize=256)
def _native_axis(in_size: int, out_size: int, mode: Mode) -> tuple[Any, Any, Any, int, int]:
    """``axis_weights`` as the extension takes them: (start int32, size int32, weights int16, ksize, p)."""
    ax = axis_weights(in_size, out_size, mode)
    start, size = ax.xmin.astype(np.int32), ax.xsize.astype(np.int32)
    weights = np.ascontiguousarray(ax.weights)
    for arr in (start, size, weights):
        arr.flags.writeable = False  # cached and shared between threads
    return start, size, weights, int(weights.shape[1]), ax.precision


def resize_uint8_tv_native(pixels: npt.NDArray[np.uint8], size_hw: tuple[int, int], mode: Mode,
                           simd: bool = True) -> npt.NDArray[np.uint8]:
    """:func:`resize_uint8_tv` on the compiled passes (``simd`` False: the portable C kernels even
    where the AVX2 ones run).  The GIL is released while it computes.

    Raises:
        RuntimeError: the extension is not built.
    """
    if _native is None:
        raise RuntimeError("mmgate._native.tvresize is not built")
    h, w = _checked(pixels, size_hw, mode)
    height, width, channels = pixels.shape
    if (h, w) == (height, width):
        return np.array(pixels, copy=True, order="C")
    src = np.ascontiguousarray(pixels)
    out = np.empty((h, w, channels), np.uint8)
    _native.resize(src, out, height, width, channels, h, w,
                   _native_axis(width, w, mode) if w != width else None,
                   _native_axis(height, h, mode) if h != height else None, simd)
    return out


def resize_uint8_tv_numpy(pixels: npt.NDArray[np.uint8], size_hw: tuple[int, int],
                          mode: Mode) -> npt.NDArray[np.uint8]:
    """:func:`resize_uint8_tv` as banded matrix products in numpy (the fallback; see the module doc)."""
    h, w = _checked(pixels, size_hw, mode)
    height, width, channels = pixels.shape
    if (h, w) == (height, width):
        return np.array(pixels, copy=True, order="C")

    vplan = _pass_plan(height, h, mode if h != height else "identity")
    hplan = _pass_plan(width, w, mode) if w != width else None
    exact32 = vplan.fits_float32 and (hplan is None or hplan.fits_float32)
    dtype: type[np.floating] = np.float32 if exact32 else np.float64
    result = np.empty((h, w * channels), np.uint8)

    if hplan is None:
        rows = _SCRATCH.get("inter", (height, width, channels), dtype)
        np.copyto(rows, pixels)
        np.subtract(rows, 128, out=rows)
        _vertical(vplan, rows.reshape(height, width * channels), False, result)
    else:
        inter = _SCRATCH.get("inter", (w, channels * height), dtype)
        _horizontal(hplan, pixels, inter)
        # [w, C, H] -> [w*C, H]: its transposed windows are rows of the HWC output
        _vertical(vplan, inter.reshape(w * channels, height), True, result)
    return result.reshape(h, w, channels)
