"""The one-pass row writer (``models/image_rows.py``) against a plain table gather + patchify.

The family parity tests (``tests/families``) compare ``preprocess_one`` with the
transformers processors themselves; these tests pin the pieces the fast path adds:
the formula chosen for every rescale/normalize flag combination and both backends
equals the ``[C, 256]`` table, the table-gather fallback, block boundaries (row
counts that are not a multiple of the block), raw uint8 rows, and the sink calls.
"""

from __future__ import annotations

import numpy as np
import pytest

from mmgate.models import geometry
from mmgate.models.image_rows import RowNormalizer, image_rows, patch_rows_u8, write_rows
from mmgate.models.backend import ImageBackend

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
