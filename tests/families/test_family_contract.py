"""The contract every registered model family keeps (ARCHITECTURE.md, "The family interface").

For every ``model_type`` in ``mmgate.models.registry.FAMILY_BY_MODEL_TYPE``:
* a golden fixture under ``tests/families/golden/`` covers it (a family
  without one fails here: add it to ``scripts/gen_golden.py``);
* ``preprocess_one`` returns exactly the rows ``plan`` announced
  (``num_patches`` = product of ``grid_thw``), and ``assemble`` stacks them;
* ``expand(plan)`` has ``plan.num_tokens`` ids, and ``num_tokens`` =
  ``t*h*w // merge_size**2`` with ``merge_size`` as the reference processor
  reported it (recorded in the golden fixture, not read from mmgate).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from parity_support import GOLDEN_DIR, ImageSpec, find_bundle_dir

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.media.image import decode_image
from mmgate.models.bundle import load_bundle
from mmgate.models.registry import FAMILY_BY_MODEL_TYPE, load_family
from mmgate.settings import ImageBackend
from mmgate.types import Modality

MODEL_TYPES = sorted(FAMILY_BY_MODEL_TYPE)
BACKENDS = (ImageBackend.PIL, ImageBackend.TORCHVISION)
#: (width, height): tiny, thin, off-grid, exact grid, wide
SIZES = ((1, 1), (1, 57), (29, 27), (33, 31), (64, 128), (448, 448), (640, 480), (1000, 5))


@lru_cache(maxsize=1)
def golden_bundles() -> dict[str, list[dict]]:
    """model_type -> the bundle entries of every golden fixture that covers it."""
    covered: dict[str, list[dict]] = {}
    for path in sorted(GOLDEN_DIR.glob("*.json")):
        golden = json.loads(path.read_text(encoding="utf-8"))
        rows_by_bundle = {r["bundle"] for r in golden.get("rows", [])}
        for entry in golden.get("bundles", []):
            if entry["bundle"] in rows_by_bundle:
                covered.setdefault(entry["model_type"], []).append({**entry, "fixture": path.name})
    return covered


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_registered_family_has_a_golden_fixture(model_type: str) -> None:
    assert model_type in golden_bundles(), (
        f"{FAMILY_BY_MODEL_TYPE[model_type].__name__} serves model_type {model_type!r} but no fixture in "
        f"{GOLDEN_DIR} covers it: add its bundle to scripts/gen_golden.py and regenerate"
    )


@lru_cache(maxsize=None)
def family_for(model_type: str, backend: ImageBackend):
    entries = golden_bundles().get(model_type)
    if not entries:
        pytest.fail(f"no golden fixture covers {model_type!r}")
    entry = entries[0]
    path = find_bundle_dir(entry["bundle"])
    if path is None:
        pytest.skip(f"model bundle {entry['bundle']} not on MMGATE_MODEL_PATH / ../shared/models")
    bundle = load_bundle(Path(path))
    family = load_family(bundle, load_tokenizer(bundle), backend)
    assert family is not None and bundle.model_type == model_type
    return family, entry


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_preprocess_rows_and_expansion_agree_with_the_plan(model_type: str, backend: ImageBackend) -> None:
    family, entry = family_for(model_type, backend)
    merge = entry["merge_size"]
    decoded_all, plans, rows_all = [], [], []
    for i, (w, h) in enumerate(SIZES):
        decoded = decode_image(ImageSpec(w, h, "RGB", 500 + i).encode(), 10**9)
        plan = family.plan(Modality.IMAGE, decoded.height, decoded.width)
        t, gh, gw = plan.grid_thw
        rows = family.preprocess_one(decoded, plan)
        label = f"{model_type} {backend.value} {w}x{h}: plan {plan}"
        assert plan.original_hw == (h, w), label
        assert plan.num_patches == t * gh * gw, label
        assert rows.dtype == np.float32 and rows.ndim == 2, label
        assert rows.shape[0] == plan.num_patches, label
        if "patch_size" in entry:
            assert plan.resized_hw == (gh * entry["patch_size"], gw * entry["patch_size"]), label
        assert plan.num_tokens == t * gh * gw // merge**2, label
        rep = family.expand(plan)
        assert len(rep.token_ids) == plan.num_tokens, label
        assert 0 <= rep.embed_offset and rep.embed_offset + rep.embed_length <= len(rep.token_ids), label
        anchor = family.anchor_token_id(Modality.IMAGE)
        assert set(rep.token_ids[rep.embed_offset:rep.embed_offset + rep.embed_length]) == {anchor}, label
        decoded_all.append(decoded)
        plans.append(plan)
        rows_all.append(rows)
    batch = family.assemble(rows_all, plans)
    pv = batch.tensors[next(iter(batch.flat_keys))]
    sizes = batch.tensors[batch.flat_keys[next(iter(batch.flat_keys))]]
    assert pv.shape[0] == sum(pl.num_patches for pl in plans)
    assert sizes.tolist() == [pl.num_patches for pl in plans]
    assert np.array_equal(pv, np.concatenate(rows_all, axis=0))
    for key in batch.batched_keys:
        assert batch.tensors[key].shape[0] == len(plans), key


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_pixel_cache_hit_equals_miss(model_type: str) -> None:
    """Through the pipeline's preprocessing step: a cached image gives the bytes a fresh one gives."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from mmgate.cache import PixelCache
    from mmgate.pipeline import Pipeline

    family, _ = family_for(model_type, BACKENDS[0])
    first = decode_image(ImageSpec(97, 61, "RGB", 900).encode(), 10**9)
    images = [first, decode_image(ImageSpec(640, 480, "RGB", 901).encode(), 10**9), first]
    cache = PixelCache(256 * 1024 * 1024)
    with ThreadPoolExecutor(2) as pool:
        pipe = Pipeline.__new__(Pipeline)
        pipe.executor, pipe.cache = pool, cache

        def run() -> np.ndarray:
            batch, _ = asyncio.run(pipe._preprocess(family, images, frozenset({Modality.IMAGE}), None))
            return batch.tensors["pixel_values"]

        miss = run()
        assert len(cache) == 2  # the repeated image is one entry
        hit = run()
    assert miss.dtype == hit.dtype and np.array_equal(miss, hit)
