"""The one-pass row writer (``models/image_rows.py``) against a plain table gather + patchify.

The family parity tests (``tests/families``) compare ``preprocess_one`` with the
transformers processors themselves; these tests pin the pieces the fast path adds:
the formula chosen for every rescale/normalize flag combination and both backends
equals the ``[C, 256]`` table, the table-gather fallback, block boundaries (row
counts that are not a multiple of the block), raw uint8 rows, the sink calls, and rows computed in
place into a :class:`~mmgate.types.RowArray` (the request bytes).
"""

from __future__ import annotations

import numpy as np
import pytest

from mmgate.models import geometry, patch_native
from mmgate.models.image_rows import RowNormalizer, image_rows, patch_rows_u8, write_rows
from mmgate.models.backend import ImageBackend
from mmgate.types import RowArray, shifted

CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


def _gather(pixels: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """``lut[c, pixels[..., c]]``: the table applied value by value (uint8 ``[..., C]`` -> float32)."""
    out = np.empty(pixels.shape, dtype=lut.dtype)
    for c in range(pixels.shape[-1]):
        out[..., c] = lut[c][pixels[..., c]]
    return out


def _patchify(image: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """transformers 5.24 ``Qwen2VLImageProcessor.patchify`` of one ``[H, W, C]`` image, written out plainly:
    ``[C, gh/m, m, p, gw/m, m, p]`` -> ``(gh/m, gw/m, m, m, C, T, p, p)``, each patch repeated T times."""
    height, width, channels = image.shape
    gh, gw = height // patch, width // patch
    x = image.transpose(2, 0, 1).reshape(channels, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)[:, :, :, :, :, None]
    x = np.repeat(x, temporal, axis=5)
    return x.reshape(gh * gw, channels * temporal * patch * patch)


def _reference_rows(image: np.ndarray, lut: np.ndarray, patch: int, temporal: int) -> np.ndarray:
    return _patchify(_gather(image, lut), patch, 2, temporal)


@pytest.mark.parametrize("backend", [ImageBackend.PIL, ImageBackend.TORCHVISION])
@pytest.mark.parametrize("mean_std", [CLIP, HALF], ids=["clip", "half"])
@pytest.mark.parametrize("flags", [(True, True), (True, False), (False, True), (False, False)])
def test_formula_equals_table_for_every_byte(backend: ImageBackend, mean_std: tuple, flags: tuple[bool, bool]) -> None:
    mean, std = mean_std
    lut = geometry.normalize_lut(backend, 1 / 255, mean, std, *flags)
    normalizer = RowNormalizer.for_table(lut, 1 / 255, mean, std, *flags)
    domain = np.broadcast_to(np.arange(256, dtype=np.uint8), (2, 3, 256))
    out = np.empty((2, 3, 256), dtype=np.float32)
    normalizer(domain, out)
    assert np.array_equal(out[0].view(np.uint32), lut.view(np.uint32))
    assert np.array_equal(out[1].view(np.uint32), lut.view(np.uint32))


def test_table_gather_fallback_when_no_formula_matches() -> None:
    mean, std = CLIP
    lut = geometry.normalize_lut(ImageBackend.PIL, 1 / 255, mean, std, True, True).copy()
    lut[1, 77] = np.nextafter(lut[1, 77], np.float32(10))  # no formula gives this table
    normalizer = RowNormalizer.for_table(lut, 1 / 255, mean, std, True, True)
    assert normalizer.formula is None
    image = np.random.default_rng(3).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    image[0, 0] = (0, 77, 0)
    got = image_rows(image, 14, 2, 2, normalizer)
    assert np.array_equal(got.view(np.uint32), _reference_rows(image, lut, 14, 2).view(np.uint32))


@pytest.mark.parametrize("hw, patch", [((28, 28), 14), ((32, 96), 16), ((14 * 2 * 9, 14 * 2 * 11), 14),
                                       ((960, 1280), 16)])
@pytest.mark.parametrize("block_rows", [1, 7, 64, 10_000])
def test_blocks_cover_every_row_once(hw: tuple[int, int], patch: int, block_rows: int) -> None:
    mean, std = HALF
    lut = geometry.normalize_lut(ImageBackend.TORCHVISION, 1 / 255, mean, std, True, True)
    normalizer = RowNormalizer.for_table(lut, 1 / 255, mean, std, True, True)
    image = np.random.default_rng(hw[0]).integers(0, 256, (*hw, 3), dtype=np.uint8)
    expected = _reference_rows(image, lut, patch, 2)
    out = np.full(expected.shape, np.nan, dtype=np.float32)
    calls: list[tuple[int, int]] = []

    def sink(first: int, rows: np.ndarray) -> None:
        calls.append((first, len(rows)))
        out[first:first + len(rows)] = rows

    assert write_rows(image, patch, 2, 2, normalizer, sink, block_rows=block_rows) == len(expected)
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))
    starts = [first for first, _ in calls]
    assert starts == sorted(starts) and sum(n for _, n in calls) == len(expected)


@pytest.mark.parametrize("temporal", [1, 2, 3])
def test_raw_uint8_rows_and_temporal_repeat(temporal: int) -> None:
    image = np.random.default_rng(temporal).integers(0, 256, (64, 32, 3), dtype=np.uint8)
    got = image_rows(image, 16, 2, temporal, None)
    assert got.dtype == np.uint8
    assert np.array_equal(got, _patchify(image, 16, 2, temporal))
    assert patch_rows_u8(image, 16, 2).shape == (8, 3, 256)


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_bands_write_disjoint_row_ranges_that_cover_the_image(parts: int) -> None:
    mean, std = CLIP
    lut = geometry.normalize_lut(ImageBackend.PIL, 1 / 255, mean, std, True, True)
    normalizer = RowNormalizer.for_table(lut, 1 / 255, mean, std, True, True)
    image = np.random.default_rng(parts).integers(0, 256, (28 * 7, 28 * 4, 3), dtype=np.uint8)
    expected = _reference_rows(image, lut, 14, 2)
    out = np.full(expected.shape, np.nan, dtype=np.float32)
    written = np.zeros(len(expected), dtype=np.int64)

    def sink(first: int, rows: np.ndarray) -> None:
        out[first:first + len(rows)] = rows
        written[first:first + len(rows)] += 1

    total = sum(write_rows(image, 14, 2, 2, normalizer, sink, block_rows=5, band=(k, parts)) for k in range(parts))
    assert total == len(expected) and (written == 1).all()
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("native", [pytest.param(True, marks=pytest.mark.skipif(
    not patch_native.NATIVE, reason="mmgate._native.patchrows is not built")), False], ids=["kernel", "numpy"])
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("parts", [1, 3])
def test_rows_computed_in_place_into_a_row_array(native: bool, offset: int, parts: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A :class:`RowArray` sink (the request bytes, at any byte address): the kernel writes each band straight
    into it (never through its block buffer), the numpy path copies its blocks in; every row lands once, with
    the reference's values."""
    monkeypatch.setattr(patch_native, "blocks", _no_blocks)
    mean, std = CLIP
    lut = geometry.normalize_lut(ImageBackend.PIL, 1 / 255, mean, std, True, True)
    normalizer = RowNormalizer.for_table(lut, 1 / 255, mean, std, True, True)
    image = np.random.default_rng(parts + offset).integers(0, 256, (28 * 5, 28 * 3, 3), dtype=np.uint8)
    expected = _reference_rows(image, lut, 14, 2)
    first = 4  # the item's rows start after another item's
    raw = np.full(offset + (first + len(expected) + 2) * expected.shape[1] * 4, 0xAB, dtype=np.uint8)
    rows = raw[offset:].view(np.float32).reshape(-1, expected.shape[1])
    sink = RowArray(rows)
    total = sum(write_rows(image, 14, 2, 2, normalizer, shifted(sink, first), block_rows=5, band=(k, parts),
                           native=native) for k in range(parts))
    assert total == len(expected)
    assert np.array_equal(rows[first:first + len(expected)].view(np.uint32), expected.view(np.uint32))
    untouched = np.concatenate([raw[:offset + first * expected.shape[1] * 4],
                                raw[offset + (first + len(expected)) * expected.shape[1] * 4:]])
    assert (untouched == 0xAB).all()


def _no_blocks(*args: object, **kwargs: object) -> None:
    raise AssertionError("a RowArray sink must be written in place, not through the block buffer")


def test_raw_rows_into_a_row_array() -> None:
    image = np.random.default_rng(7).integers(0, 256, (64, 32, 3), dtype=np.uint8)
    rows = np.zeros((8, 3 * 2 * 16 * 16), dtype=np.uint8)
    assert write_rows(image, 16, 2, 2, None, RowArray(rows)) == 8
    assert np.array_equal(rows, _patchify(image, 16, 2, 2))


def test_row_array_refuses_what_does_not_fit() -> None:
    rows = np.zeros((4, 6), dtype=np.float32)
    sink = RowArray(rows)
    sink(1, np.ones((2, 6), dtype=np.float32))
    assert rows.sum() == 12 and rows[0].sum() == 0 and rows[3].sum() == 0
    with pytest.raises(ValueError, match="do not fit"):
        sink(0, np.ones((1, 6), dtype=np.float64))
    with pytest.raises(ValueError, match="do not fit"):
        sink(0, np.ones((1, 5), dtype=np.float32))
    with pytest.raises(ValueError, match="outside"):
        sink(3, np.ones((2, 6), dtype=np.float32))
    with pytest.raises(ValueError, match="writable C-contiguous"):
        RowArray(np.zeros((4, 6), dtype=np.float32)[:, ::2])
    read_only = np.zeros((4, 6), dtype=np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writable C-contiguous"):
        RowArray(read_only)
    assert shifted(sink, 3).array.shape == (1, 6)
    assert shifted(sink, 4).array.shape == (0, 6)  # the end: a clip or image of no rows
    for first in (5, -1):
        with pytest.raises(ValueError, match="outside"):
            shifted(sink, first)
    assert np.shares_memory(sink.rows(1, 2), rows) and sink.rows(1, 2).shape == (2, 6)
    for first, count in ((3, 2), (-1, 1), (2, -1)):
        with pytest.raises(ValueError, match="outside"):
            sink.rows(first, count)


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "numpy"])
def test_a_row_array_one_row_short_is_refused_not_filled_in_part(native: bool) -> None:
    """A plan and its writer that disagree on the rows: an error, never rows silently left unwritten."""
    image = np.random.default_rng(8).integers(0, 256, (64, 32, 3), dtype=np.uint8)  # 8 rows
    rows = np.zeros((7, 3 * 2 * 16 * 16), dtype=np.uint8)
    with pytest.raises(ValueError, match="outside"):
        write_rows(image, 16, 2, 2, None, RowArray(rows), native=native)


def test_shifted_offsets_a_plain_writer() -> None:
    calls: list[tuple[int, int]] = []
    shifted(lambda row, rows: calls.append((row, len(rows))), 10)(2, np.zeros((3, 1)))
    assert calls == [(12, 3)]
