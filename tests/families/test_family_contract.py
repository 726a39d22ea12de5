"""The contract every registered model family keeps (ARCHITECTURE.md, "The family interface").

For every ``model_type`` in ``mmgate.models.registry.FAMILY_BY_MODEL_TYPE``:
* a golden fixture under ``tests/families/golden/`` covers it (a family
  without one fails here: add it to ``scripts/gen_golden.py``);
* the image processor's specs name one primary tensor, first; ``preprocess`` returns the share
  ``plan`` announced and ``plan_tensors`` the other shares, each of the planned shape;
  :func:`mmgate.models.family.assemble` lays them out as the specs say (batched: one entry per
  item, zero-padded; flat: concatenated, sizes in the batch);
* ``expand(plan)`` holds exactly ``plan.num_tokens`` embedding tokens (token-level: in its
  placeholder range; text-level: in its text), and is text-level exactly when ``Family.text_updates``
  lists images;
* a pixel-cache hit gives the bytes a miss gives (through the pipeline);
* every family that takes audio keeps the same contract for clips (:func:`_audio_contract`; the cache test
  with ``input_audio`` parts for an audio-only family).
Family-specific numbers (token counts, sizes) are checked against the reference by each
family's golden and live tiers, not here.
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
from mmgate.models.family import assemble
from mmgate.models.registry import FAMILY_BY_MODEL_TYPE, load_family
from mmgate.models.backend import ImageBackend
from mmgate.types import ItemHints, Modality, TensorLayout

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


#: every family but the audio-only ones (whose class declares audio limits alone; image families may set theirs per
#: instance)
IMAGE_TYPES = [t for t in MODEL_TYPES if set(FAMILY_BY_MODEL_TYPE[t].limits) != {Modality.AUDIO}]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
@pytest.mark.parametrize("model_type", IMAGE_TYPES)
def test_preprocess_and_expansion_agree_with_the_plan(model_type: str, backend: ImageBackend) -> None:
    """Family-neutral: every tensor share has the shape the plan announced, the batch is laid out as
    the specs say, and the prompt update holds exactly ``num_tokens`` embedding tokens."""
    family, _ = family_for(model_type, backend)
    proc = family.image
    assert proc is not None and proc.modality is Modality.IMAGE
    assert [s.primary for s in proc.specs].count(True) == 1 and proc.specs[0].primary
    names = [s.name for s in proc.specs]
    embed_text = load_tokenizer(load_bundle(Path(find_bundle_dir(golden_bundles()[model_type][0]["bundle"])))).decode(
        [proc.placeholder_token_id], skip_special_tokens=False)
    plans, shares = [], []
    for i, (w, h) in enumerate(SIZES):
        decoded = decode_image(ImageSpec(w, h, "RGB", 500 + i).encode(), 10**9)
        plan = proc.plan(decoded.height, decoded.width)
        label = f"{model_type} {backend.value} {w}x{h}: plan {plan}"
        assert plan.original_hw == (h, w), label
        assert [n for n, _ in plan.shapes] == names, label
        share = proc.preprocess(decoded, plan)
        assert share.dtype == np.float32 and share.shape == plan.primary_shape, label
        for name, array in proc.plan_tensors(plan).items():
            assert np.asarray(array).shape == plan.shape(name), (label, name)
        rep = proc.expand(plan)
        # a range may hold separators that receive no embedding (vLLM's is_embed mask): Llama 4's tile
        # separators (token-level), InternVL3's <img> ... </img> (text-level frames too)
        assert rep.embed_length >= plan.num_tokens > 0, label
        # Family.text_updates says which modalities' updates are text-level (worker mode refuses them up front)
        assert (rep.text is not None) == (Modality.IMAGE in family.text_updates), label
        if rep.text is None:
            assert 0 <= rep.embed_offset and rep.embed_offset + rep.embed_length <= len(rep.token_ids), label
            window = rep.token_ids[rep.embed_offset:rep.embed_offset + rep.embed_length]
            assert window.count(proc.placeholder_token_id) == plan.num_tokens, label
        else:
            assert rep.text.count(embed_text) == plan.num_tokens, label
        plans.append(plan)
        shares.append(share)
    assert len(plans) >= 4, model_type  # every clip of 7,999 samples and more is planned
    batch = assemble(proc, plans, shares)
    assert batch.primary_key == names[0]
    for spec in proc.specs:
        tensor = batch.tensors[spec.name]
        assert tensor.dtype == np.dtype(spec.dtype), spec.name
        if spec.layout is TensorLayout.BATCHED:
            assert tensor.shape[0] == len(plans), spec.name
        elif spec.layout is TensorLayout.FLAT:
            rows = [pl.shape(spec.name)[0] for pl in plans]
            assert tensor.shape[0] == sum(rows), spec.name
            assert spec.sizes_key in batch.batched_keys, spec.name
            assert batch.tensors[spec.sizes_key].reshape(-1).tolist() == rows, spec.name
    primary = batch.tensors[batch.primary_key]
    if proc.specs[0].layout is TensorLayout.FLAT:
        assert np.array_equal(primary, np.concatenate(shares, axis=0))
    else:
        for k, share in enumerate(shares):
            assert np.array_equal(primary[k][tuple(slice(0, d) for d in share.shape)], share)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_pixel_cache_hit_equals_miss(model_type: str) -> None:
    """Through the pipeline's public path (``Pipeline.prepare``): a cached image gives the bytes a fresh one gives."""
    import asyncio
    import base64
    from concurrent.futures import ThreadPoolExecutor

    from mmgate.request.parse import parse_chat_request
    from mmgate.pipeline.cache import PixelCache
    from mmgate.media.fetch import MediaFetcher
    from mmgate.pipeline.prepare import Pipeline
    from mmgate.pipeline.runtime import ModelRuntime
    from mmgate.config.settings import Settings

    family, entry = family_for(model_type, BACKENDS[0])
    bundle = load_bundle(Path(find_bundle_dir(entry["bundle"])))
    runtime = ModelRuntime(bundle=bundle, tokenizer=load_tokenizer(bundle), family=family, served_name=model_type)
    modality = Modality.IMAGE if Modality.IMAGE in family.processors else Modality.AUDIO
    if modality is Modality.IMAGE:
        first = ImageSpec(97, 61, "RGB", 900).encode()
        urls = [f"data:image/png;base64,{base64.b64encode(b).decode()}"
                for b in (first, ImageSpec(640, 480, "RGB", 901).encode(), first)]
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    else:
        clips = [_wav(12_345, 900), _wav(4_000, 901)]
        parts = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(c).decode(), "format": "wav"}}
                 for c in (clips[0], clips[1], clips[0])]
    body = {"model": model_type, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}]}
    cache = PixelCache(256 * 1024 * 1024)
    settings = Settings(model=model_type, image_backend=BACKENDS[0])
    with ThreadPoolExecutor(2) as pool:
        pipe = Pipeline(runtime, settings, MediaFetcher(settings.fetch), pool, cache)

        def run() -> np.ndarray:
            prepared = asyncio.run(pipe.prepare(parse_chat_request(json.dumps(body).encode())))
            batch = next(b for b in prepared.batches if b.modality is modality)
            return batch.tensors[batch.primary_key]

        miss = run()
        assert len(cache) == 2  # the repeated image is one entry
        hit = run()
    assert miss.dtype == hit.dtype and np.array_equal(miss, hit)


AUDIO_TYPES = [t for t in MODEL_TYPES if Modality.AUDIO in FAMILY_BY_MODEL_TYPE[t].limits]


@pytest.mark.parametrize("model_type", AUDIO_TYPES)
def test_audio_plan_preprocess_and_expansion_agree(model_type: str) -> None:
    """Family-neutral, for every family that takes audio (Qwen Omni, Qwen3-ASR): :func:`_audio_contract`."""
    family, _ = family_for(model_type, BACKENDS[0])
    _audio_contract(model_type, family)


def _wav(samples: int, seed: int) -> bytes:
    """A 16 kHz mono 16-bit WAV of seeded noise."""
    import io
    import wave

    pcm = (np.random.default_rng(seed).standard_normal(samples) * 3000).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _audio_contract(model_type: str, family) -> None:  # noqa: ANN001 - a Family
    """The audio side of the contract: shares of the planned shapes, the batch laid out by the specs, the update
    holding ``num_tokens`` placeholder tokens in its range (the image contract, for clips)."""
    from mmgate.errors import ErrorCode, GatewayError
    from mmgate.media.audio import decode_audio
    from mmgate.types import ItemHints

    proc = family.processors[Modality.AUDIO]
    assert [s.primary for s in proc.specs].count(True) == 1 and proc.specs[0].primary
    names = [s.name for s in proc.specs]
    plans, shares = [], []
    for i, samples in enumerate((1, 160, 7_999, 8_000, 24_037, 96_000)):
        audio = decode_audio(_wav(samples, 700 + i), proc.sampling_rate, max_input_bytes=10**9, max_duration_s=600.0,
                             timeout_s=60.0)
        try:
            plan = proc.plan(audio, ItemHints())
        except GatewayError as exc:  # a clip shorter than the reference can frame (Qwen Omni: < 201 samples)
            assert exc.code is ErrorCode.AUDIO_TOO_SHORT and samples < 8_000, (model_type, samples, exc.code)
            continue
        label = f"{model_type} {samples} samples: plan {plan}"
        assert [n for n, _ in plan.shapes] == names, label
        share = proc.preprocess(audio, plan)
        assert share.dtype == np.float32 and share.shape == plan.primary_shape, label
        for name, array in proc.plan_tensors(plan).items():
            assert np.asarray(array).shape == plan.shape(name), (label, name)
        rep = proc.expand(plan)
        assert rep.text is None and Modality.AUDIO not in family.text_updates, label
        window = rep.token_ids[rep.embed_offset:rep.embed_offset + rep.embed_length]
        assert rep.embed_length >= plan.num_tokens > 0, label
        assert window.count(proc.placeholder_token_id) == plan.num_tokens, label
        plans.append(plan)
        shares.append(share)
    assert len(plans) >= 4, model_type  # every clip of 7,999 samples and more is planned
    batch = assemble(proc, plans, shares)
    assert batch.primary_key == names[0]
    for spec in proc.specs:
        tensor = batch.tensors[spec.name]
        assert tensor.dtype == np.dtype(spec.dtype), spec.name
        assert spec.layout is TensorLayout.BATCHED and tensor.shape[0] == len(plans), spec.name
    for k, share in enumerate(shares):
        assert np.array_equal(batch.tensors[batch.primary_key][k][tuple(slice(0, d) for d in share.shape)], share)
