"""The compiled patch-row kernel (``mmgate._native.patchrows``) against the numpy path, bit for bit.

:func:`mmgate.models.image_rows.write_rows` / :func:`~mmgate.models.image_rows.image_rows` run
the kernel when it is built (:mod:`mmgate.models.patch_native`) and the numpy path
(``patch_rows_u8`` + :class:`~mmgate.models.image_rows.RowNormalizer` + repeat along T) when it
is not; ``native=False`` forces the latter here.  The numpy path is what the Qwen-VL goldens and
the live parity tiers pin to transformers, so equality with it (``np.array_equal`` of the bit
views) is the kernel's contract:

* images: random uint8 images over patch 14 / 16, merge 2, T 1 / 2, sizes from the minimum (one
  merged patch) to a few hundred pixels with odd patch counts, every band ``(k, n)`` for n in
  1..4 (including more bands than merged rows), for the float32 table of each Qwen-VL
  configuration (both image backends' tables, with the normalizer's float32 formula and with
  its gather) and for raw uint8 (device normalize);
* clips: ``[N, H, W, C]`` frames against ``video_pixels.patchify_video`` (+ ``normalize_rows``),
  N not a multiple of T (padded with the last frame);
* destinations at any byte address (a float32 view of a serialized request's payload);
* refusals: wrong dtypes, shapes, row ranges, non-contiguous or read-only buffers, overlapping
  buffers: a clear ``TypeError`` / ``ValueError`` / ``BufferError``, never a crash.

Skipped, loudly, where the extension is not built (the fallback itself is covered by every
other test that goes through ``write_rows``).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from mmgate.models import geometry, patch_native
from mmgate.models.image_rows import RowNormalizer, image_rows, write_rows
from mmgate.models.video_pixels import normalize_rows, patchify_video
from mmgate.models.backend import ImageBackend
from mmgate.transport.placement import BufferTarget, new_bytes

needs_native = pytest.mark.skipif(not patch_native.NATIVE, reason="mmgate._native.patchrows is not built")
pytestmark = needs_native

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


def _normalizers() -> dict[str, RowNormalizer | None]:
    """Qwen2/2.5-VL (CLIP mean/std) and Qwen3-VL (0.5) tables of both backends, formula and gather."""
    out: dict[str, RowNormalizer | None] = {"raw": None}
    for name, mean, std in (("clip", CLIP_MEAN, CLIP_STD), ("half", HALF, HALF)):
        for backend in (ImageBackend.PIL, ImageBackend.TORCHVISION):
            lut = geometry.normalize_lut(backend, 1 / 255, mean, std, True, True)
            fast = RowNormalizer.for_table(lut, 1 / 255, mean, std, True, True)
            out[f"{name}-{backend.value}-{'formula' if fast.formula else 'lut'}"] = fast
            out[f"{name}-{backend.value}-gather"] = RowNormalizer(lut=lut, formula=None)
    return out


NORMALIZERS = _normalizers()


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def collect(image: np.ndarray, p: int, m: int, t: int, normalizer: RowNormalizer | None, native: bool,
            bands: int, block_rows: int = 64) -> np.ndarray:
    """Every band's rows through ``write_rows`` into one array (each row written exactly once)."""
    n = (image.shape[0] // p) * (image.shape[1] // p)
    out = np.full((n, image.shape[2] * t * p * p), 0xAB if normalizer is None else np.nan,
                  dtype=np.uint8 if normalizer is None else np.float32)
    seen = np.zeros(n, dtype=np.int64)

    def sink(first: int, rows: np.ndarray) -> None:
        out[first:first + len(rows)] = rows
        seen[first:first + len(rows)] += 1

    total = sum(write_rows(image, p, m, t, normalizer, sink, block_rows=block_rows, band=(k, bands), native=native)
                for k in range(bands))
    assert total == n and (seen == 1).all()
    return out


#: (merged patches down, across): the minimum, odd counts, a wide and a tall strip
GRIDS = [(1, 1), (1, 3), (3, 1), (2, 5), (5, 3), (7, 2)]


@pytest.mark.parametrize("norm", list(NORMALIZERS))
@pytest.mark.parametrize("patch", [14, 16])
@pytest.mark.parametrize("temporal", [1, 2])
def test_write_rows_native_equals_numpy(norm: str, patch: int, temporal: int) -> None:
    normalizer = NORMALIZERS[norm]
    rng = np.random.default_rng(patch * 10 + temporal)
    unit = patch * 2
    for gy, gx in GRIDS:
        image = rng.integers(0, 256, (gy * unit, gx * unit, 3), dtype=np.uint8)
        want = collect(image, patch, 2, temporal, normalizer, native=False, bands=1)
        assert np.array_equal(bits(image_rows(image, patch, 2, temporal, normalizer, native=False)), bits(want))
        assert np.array_equal(bits(image_rows(image, patch, 2, temporal, normalizer)), bits(want)), (gy, gx)
        for bands in (1, 2, 3, 4):
            got = collect(image, patch, 2, temporal, normalizer, native=True, bands=bands, block_rows=5)
            assert np.array_equal(bits(got), bits(want)), (gy, gx, bands)


def test_every_byte_value_every_channel() -> None:
    """All 256 byte values in each channel, so every table entry is gathered at least once."""
    values = np.arange(256, dtype=np.uint8)
    image = np.stack([np.resize(values, (64, 64)), np.resize(values[::-1], (64, 64)),
                      np.resize(np.roll(values, 77), (64, 64))], axis=-1)
    for norm, normalizer in NORMALIZERS.items():
        for t in (1, 2):
            want = image_rows(image, 16, 2, t, normalizer, native=False)
            assert np.array_equal(bits(image_rows(image, 16, 2, t, normalizer)), bits(want)), norm


def test_channels_one_and_four() -> None:
    """The kernel's generic and specialised channel counts (Qwen images are RGB; the kernel is not bound to 3)."""
    rng = np.random.default_rng(7)
    for channels in (1, 2, 4, 5):
        image = rng.integers(0, 256, (56, 84, channels), dtype=np.uint8)
        lut = rng.standard_normal((channels, 256)).astype(np.float32)
        for normalizer in (RowNormalizer(lut=lut, formula=None), None):
            want = image_rows(image, 14, 2, 2, normalizer, native=False)
            assert np.array_equal(bits(image_rows(image, 14, 2, 2, normalizer)), bits(want)), channels


@pytest.mark.parametrize("frames", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("patch", [14, 16])
def test_clip_rows_equal_patchify_video(frames: int, patch: int) -> None:
    rng = np.random.default_rng(frames)
    clip = rng.integers(0, 256, (frames, patch * 4, patch * 6, 3), dtype=np.uint8)
    normalizer = NORMALIZERS["half-torchvision-formula"]
    assert normalizer is not None
    raw = patchify_video(clip, patch, 2, 2)
    rows = patch_native.row_count(clip.shape, patch, 2)
    got = np.empty((rows, 3 * 2 * patch * patch), np.uint8)
    patch_native.fill_rows(clip, patch, 2, 2, None, got)
    assert np.array_equal(got, raw)
    got_f = np.empty(got.shape, np.float32)
    patch_native.fill_rows(clip, patch, 2, 2, normalizer.lut, got_f)
    assert np.array_equal(bits(got_f), bits(normalize_rows(raw, normalizer)))
    # any row range on its own
    part = np.empty((3, got.shape[1]), np.float32)
    patch_native.fill_rows(clip, patch, 2, 2, normalizer.lut, part, first_row=rows - 3)
    assert np.array_equal(bits(part), bits(got_f[rows - 3:]))


@pytest.mark.parametrize("offset", [0, 1, 2, 3, 5])
def test_unaligned_destination(offset: int) -> None:
    """A float32 ``out`` at any byte address (a request payload), and a BufferTarget fed by write_rows."""
    rng = np.random.default_rng(offset)
    image = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    normalizer = NORMALIZERS["clip-pil-gather"]
    want = image_rows(image, 16, 2, 2, normalizer, native=False)
    raw = np.zeros(want.nbytes + offset, np.uint8)
    out = raw[offset:].view(np.float32).reshape(want.shape)
    assert out.flags.aligned == (offset % 4 == 0)
    assert out.flags.c_contiguous
    patch_native.fill_rows(image, 16, 2, 2, normalizer.lut if normalizer else None, out)
    assert np.array_equal(bits(out), bits(want))
    for values in (None, np.dtype(np.float32)):  # blocks copied in; rows computed in place (a RowArray)
        data, view = new_bytes(want.nbytes + offset)
        target = BufferTarget(view[offset:], want.shape[1], 4, owner=data, values=values)
        with target.writer() as put:
            write_rows(image, 16, 2, 2, normalizer, put)
        assert data[offset:] == want.tobytes()


def _ok_args() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    image = np.zeros((32, 64, 3), np.uint8)
    lut = np.zeros((3, 256), np.float32)
    out = np.empty((8, 3 * 2 * 16 * 16), np.float32)
    return image, lut, out


def test_wrapper_refuses_bad_arguments() -> None:
    image, lut, out = _ok_args()
    patch_native.fill_rows(image, 16, 2, 2, lut, out)  # the good call
    with pytest.raises(TypeError, match="uint8"):
        patch_native.fill_rows(image.astype(np.float32), 16, 2, 2, lut, out)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="float32"):
        patch_native.fill_rows(image, 16, 2, 2, lut, out.astype(np.float64))
    with pytest.raises(TypeError, match="uint8"):
        patch_native.fill_rows(image, 16, 2, 2, None, out)  # raw rows need a uint8 out
    with pytest.raises(TypeError, match="float32"):
        patch_native.fill_rows(image, 16, 2, 2, lut.astype(np.float64), out)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[3, 256\]"):
        patch_native.fill_rows(image, 16, 2, 2, lut[:, :255], out)
    with pytest.raises(ValueError, match="merged patches"):
        patch_native.fill_rows(image[:31], 16, 2, 2, lut, out)
    with pytest.raises(ValueError, match="merged patches"):
        patch_native.fill_rows(image[:, :48], 16, 2, 2, lut, out)
    with pytest.raises(ValueError, match=r"\[rows, 1536\]"):
        patch_native.fill_rows(image, 16, 2, 2, lut, out[:, :-1])
    with pytest.raises(ValueError, match=r"\[rows, 1536\]"):
        patch_native.fill_rows(image, 16, 2, 2, lut, out.reshape(-1))
    with pytest.raises(ValueError, match="outside"):
        patch_native.fill_rows(image, 16, 2, 2, lut, np.empty((9, 1536), np.float32))
    with pytest.raises(ValueError, match="outside"):
        patch_native.fill_rows(image, 16, 2, 2, lut, out[:4], first_row=5)
    with pytest.raises(ValueError, match="C-contiguous"):
        patch_native.fill_rows(image, 16, 2, 2, lut, np.empty((1536, 8), np.float32).T)
    frozen = out.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        patch_native.fill_rows(image, 16, 2, 2, lut, frozen)
    with pytest.raises(ValueError, match=r"\[H, W, C\]"):
        patch_native.fill_rows(image[..., 0], 16, 2, 2, lut, out)
    with pytest.raises(ValueError, match=r"\[H, W, C\]"):
        list(patch_native.blocks(image[..., 0], 16, 2, 2, lut, 4))
    with pytest.raises(TypeError, match="uint8"):
        list(patch_native.blocks(image.astype(np.float32), 16, 2, 2, lut, 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="merged patches"):
        list(patch_native.blocks(image[:, :48], 16, 2, 2, lut, 4))
    # a non-contiguous image is copied first (same rows)
    wide = np.zeros((32, 128, 3), np.uint8)
    wide[:, ::2] = np.arange(32 * 64 * 3, dtype=np.uint8).reshape(32, 64, 3)
    strided = wide[:, ::2]
    got = np.empty_like(out)
    patch_native.fill_rows(strided, 16, 2, 2, lut + np.arange(256, dtype=np.float32), got)
    assert np.array_equal(got, image_rows(np.ascontiguousarray(strided), 16, 2, 2,
                                          RowNormalizer(lut=lut + np.arange(256, dtype=np.float32), formula=None),
                                          native=False))


def test_extension_refuses_bad_buffers() -> None:
    """The C entry point itself checks what the wrapper checks for memory safety."""
    native = patch_native._native
    assert native is not None
    image, lut, out = _ok_args()
    args = (1, 32, 64, 3, 16, 2, 2, 0, 8)
    native.patch_rows(image, out, lut, *args)
    with pytest.raises(ValueError, match="src holds"):
        native.patch_rows(image[:16], out, lut, *args)
    with pytest.raises(ValueError, match="dst holds"):
        native.patch_rows(image, out[:7], lut, *args)
    with pytest.raises(ValueError, match="lut holds"):
        native.patch_rows(image, out, lut[:2], *args)
    with pytest.raises(ValueError, match="outside"):
        native.patch_rows(image, out, lut, 1, 32, 64, 3, 16, 2, 2, 1, 8)
    with pytest.raises(ValueError, match="multiples"):
        native.patch_rows(image, out, lut, 1, 32, 48, 3, 16, 2, 2, 0, 6)
    with pytest.raises(ValueError, match="out of range"):
        native.patch_rows(image, out, lut, 1, 32, 64, 0, 16, 2, 2, 0, 8)
    with pytest.raises(ValueError, match="out of range"):
        native.patch_rows(image, out, lut, 1, 32, 64, 3, 16, 2, 2, -1, 8)
    with pytest.raises(ValueError, match="too large"):
        native.patch_rows(image, out, lut, 1 << 40, 1 << 20, 64, 3, 16, 2, 2, 0, 8)
    with pytest.raises(ValueError, match="overlaps"):
        both = np.zeros(image.nbytes + out.nbytes, np.uint8)
        native.patch_rows(both, both, lut, *args)
    with pytest.raises((BufferError, ValueError, TypeError)):
        native.patch_rows(np.zeros((32, 128, 3), np.uint8)[:, ::2], out, lut, *args)  # not contiguous
    with pytest.raises((BufferError, ValueError, TypeError)):
        native.patch_rows(image, np.empty((1536, 8), np.float32).T, lut, *args)  # not contiguous
    with pytest.raises(TypeError):
        native.patch_rows(image, b"\0" * out.nbytes, lut, *args)  # read-only dst
    with pytest.raises(TypeError):
        native.patch_rows(image, out, 3.0, *args)  # not a buffer


def test_fallback_logs_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Without the extension, write_rows runs the numpy path (same rows) and says so once."""
    image = np.random.default_rng(3).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    want = image_rows(image, 16, 2, 2, None)
    monkeypatch.setattr(patch_native, "NATIVE", False)
    monkeypatch.setattr(patch_native, "_fallback_logged", type(patch_native._fallback_logged)())
    with caplog.at_level(logging.WARNING, logger="mmgate.models.patch_native"):
        assert np.array_equal(image_rows(image, 16, 2, 2, None), want)
        assert np.array_equal(image_rows(image, 16, 2, 2, None), want)
    assert sum("patchrows is not built" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.skipif(not patch_native.NATIVE, reason="the extension is not built")
@pytest.mark.parametrize("backend", [ImageBackend.PIL, ImageBackend.TORCHVISION])
@pytest.mark.parametrize("model", ["Qwen/Qwen2-VL-2B-Instruct", "Qwen/Qwen3-VL-2B-Instruct"])
def test_native_rows_equal_the_transformers_processor(model: str, backend: ImageBackend) -> None:
    """The reference itself: transformers' Qwen-VL image processor of the bundle (the ``...Pil`` / PIL
    class and the torchvision one), ``do_resize=False`` on an image whose sides are already multiples of
    ``patch_size * merge_size``, gives the same ``pixel_values`` bits as one kernel call with the
    backend's normalization table."""
    from transformers import AutoImageProcessor

    from tests.conftest import bundle_dir

    processor = AutoImageProcessor.from_pretrained(bundle_dir(model), use_fast=backend is ImageBackend.TORCHVISION)
    p, m, t = processor.patch_size, processor.merge_size, processor.temporal_patch_size
    rng = np.random.default_rng(7)
    image = rng.integers(0, 256, (3 * p * m, 5 * p * m, 3), dtype=np.uint8)
    want = np.asarray(processor(images=[image], do_resize=False, return_tensors="np")["pixel_values"])
    lut = geometry.normalize_lut(backend, processor.rescale_factor, tuple(processor.image_mean),
                                 tuple(processor.image_std), True, True)
    got = np.empty(want.shape, dtype=np.float32)
    patch_native.fill_rows(image, p, m, t, lut, got)
    assert np.array_equal(bits(got), bits(want.astype(np.float32)))
