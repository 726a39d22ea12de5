"""Tier (b): live differential of the InternVL3 family against transformers (both image backends).

References (transformers 5.24, bundle ``OpenGVLab--InternVL3-1B-hf``):
* ``torchvision``: ``AutoProcessor.from_pretrained(bundle)`` (``InternVLProcessor`` with
  ``GotOcr2ImageProcessor``); ``pil``: the same processor built with
  ``AutoImageProcessor.from_pretrained(bundle, backend="pil")`` (``GotOcr2ImageProcessorPil``);
* pixels: the image processor called with ``InternVLProcessor.images_kwargs`` (``crop_to_patches``
  True); ``pixel_values`` must be identical (``np.array_equal``) to mmgate's and its
  ``num_patches`` equal to mmgate's ``image_num_patches`` (``decode_image`` -> ``plan`` ->
  ``preprocess`` -> ``assemble``);
* prompts: ``processor(text=apply_chat_template(tokenize=False), images=...)``; mmgate's rendered
  prompt, tokenized, each ``<IMG_CONTEXT>`` anchor spliced with ``expand(plan).token_ids``, must give
  the same ids and the batch the same ``pixel_values``.

The corpus: edge sizes on every tiling boundary (each exact grid ratio with the area just under and
over the tie-break threshold ``0.5 * 448^2 * cols * rows``, ratios midway between two grids, 1 and 12
tiles, 448 exactly, thin strips, every image mode, JPEG) and random sizes from a seeded RNG
(``MMGATE_PARITY_SEED`` pins it; printed): mostly small sides (the cost is the 448-px canvas, not the
source), a third on exact or midway grid ratios.  Default run: 12 edge + 8 random sizes per backend;
``slow``: every edge size and >= 200 random sizes.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from functools import lru_cache

import live_support as live
import numpy as np
import pytest
from parity_support import ImageSpec, reference_messages, template_messages
from PIL import Image

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from mmgate.chat.template import render_chat  # noqa: E402
from mmgate.errors import GatewayError  # noqa: E402
from mmgate.media.image import decode_image  # noqa: E402
from mmgate.models.backend import ImageBackend  # noqa: E402
from mmgate.models.family import assemble  # noqa: E402
from mmgate.models.internvl import supported_grids  # noqa: E402
from mmgate.pipeline.planning import splice_all  # noqa: E402

INTERNVL_BUNDLE = "OpenGVLab--InternVL3-1B-hf"
SEED = live.live_seed("internvl")
NUM_RANDOM = 200
NUM_SAMPLE_EDGE, NUM_SAMPLE_RANDOM = 12, 8
MAX_DECODE_PIXELS = live.MAX_DECODE_PIXELS
TILE = 448


# ---------------------------------------------------------------- corpus


def _threshold_side(m: int) -> int:
    """The smallest k such that a (cols*k) x (rows*k) image's area exceeds the tie-break threshold
    ``0.5 * 448^2 * (m*cols) * (m*rows)`` of the same-ratio grid m times larger
    (``get_optimal_tiled_canvas``): sides ``k - 1`` and ``k`` straddle it (m = 2: 634; m = 3: 951)."""
    return math.isqrt(TILE * TILE * m * m // 2) + 1


def edge_specs(seed: int) -> list[ImageSpec]:
    sizes = [  # (width, height)
        (1, 1), (1, 2), (2, 1), (1, 57), (57, 1), (3, 1500), (1500, 3), (448, 448), (447, 449), (449, 447),
        (896, 448), (448, 896), (5376, 448), (448, 5376), (480, 40), (520, 40), (440, 40), (40, 480),
        (500, 400), (1000, 800), (400, 500), (800, 1000),  # ratio 1.25: midway between 1 and 1.5, tie by area
        (1300, 700), (700, 1300), (900, 400), (64, 48),
    ]
    for cols, rows in ((1, 1), (2, 1), (1, 2), (3, 2), (2, 3), (3, 1), (1, 3)):
        # exact grid ratio with the area just under / over each larger same-ratio grid's threshold
        for m in (2, 3):
            if cols * rows * m * m <= 12:
                side = _threshold_side(m)
                sizes += [(cols * (side - 1), rows * (side - 1)), (cols * side, rows * side)]
    specs = [ImageSpec(w, h, "RGB", seed + i, name="edge") for i, (w, h) in enumerate(dict.fromkeys(sizes))]
    return specs + live.mode_specs(seed, lambda j: (300 + 3 * j, 101), lambda j: (61, 97 + 7 * j), (523, 389))


def random_specs(rng: np.random.Generator, count: int) -> list[ImageSpec]:
    """Log-uniform sides 1..1200; a third on an exact or midway grid ratio (the ties)."""
    ratios = sorted({c / r for c, r in supported_grids(1, 12)})
    specs: list[ImageSpec] = []
    while len(specs) < count:
        if len(specs) % 3 == 0:
            k = int(rng.integers(0, len(ratios) - 1))
            ratio = ratios[k] if rng.random() < 0.5 else (ratios[k] + ratios[k + 1]) / 2
            h = int(rng.integers(8, 700))
            w = max(1, round(h * ratio))
        else:
            w, h = (round(math.exp(v)) for v in rng.uniform(0.0, math.log(1200), size=2))
        specs.append(live.random_spec(rng, w, h))
    return specs


@dataclass
class Case(live.Reference):
    edges: list = field(default_factory=list)
    randoms: list = field(default_factory=list)


@lru_cache(maxsize=1)
def case() -> Case:
    ref = live.load_reference(INTERNVL_BUNDLE, "GotOcr2ImageProcessor")
    assert type(ref.ref_processor[ImageBackend.TORCHVISION]).__name__ == "InternVLProcessor"
    return Case(**vars(ref), edges=edge_specs(SEED % 100_000),
                randoms=random_specs(np.random.default_rng(SEED), NUM_RANDOM))


# ---------------------------------------------------------------- comparison (test_live_parity.py runs it)


def compare_one(key: str, backend: ImageBackend, job: live.Job, data: bytes) -> tuple[str, float]:
    """``pixel_values`` identical and ``image_num_patches`` equal to the reference's ``num_patches``."""
    from transformers import InternVLProcessor

    c = case()
    ref = c.ref_image[backend](images=[Image.open(io.BytesIO(data))], **InternVLProcessor.images_kwargs,
                               return_tensors="np")
    proc = c.families[backend].image
    try:
        decoded = decode_image(data, MAX_DECODE_PIXELS)
        plan = proc.plan(decoded.height, decoded.width)
        batch = assemble(proc, [plan], [proc.preprocess(decoded, plan)])
    except GatewayError as exc:
        return f"mmgate refused ({exc.code}: {exc})", math.nan
    problems, diff = live.tensor_problems(
        {"pixel_values": ref["pixel_values"], "image_num_patches": np.asarray(ref["num_patches"])},
        {k: v for k, v in batch.tensors.items() if k != "image_token_id"})
    return ("; ".join(problems) if problems else live.EQUAL), diff


def check_results(key: str, backend: ImageBackend, results: list[live.Result]) -> None:
    """Some comparisons cut crops (with the thumbnail), some reach the 12-tile maximum."""
    proc = case().families[backend].image
    patches = [proc.plan(r.job.spec.height, r.job.spec.width).primary_shape[0]
               for r in results if r.outcome == live.EQUAL]
    print(f"[internvl {backend.value}] {sum(p > 1 for p in patches)} comparisons with crops, "
          f"{patches.count(13)} with 12 crops")
    assert any(p > 1 for p in patches) and 1 in patches


def sample() -> list[ImageSpec]:
    c = case()
    step = max(1, len(c.edges) // NUM_SAMPLE_EDGE)
    return c.edges[::step][:NUM_SAMPLE_EDGE] + c.randoms[:NUM_SAMPLE_RANDOM]


def full_corpus(key: str) -> list[live.Job]:
    c = case()
    assert len(c.randoms) >= 200
    return [live.Job(s) for s in c.edges + c.randoms]


LIVE = live.LiveFamily(
    label="internvl", keys=("internvl",), key_id=str, seed=SEED, compare=compare_one, full=full_corpus,
    sample=lambda key: [live.Job(s) for s in sample()], check_results=check_results,
)


# ---------------------------------------------------------------- conversations

CONVERSATIONS = (
    [("user", ["look:\n", 0, "\nnow"])],
    [("system", ["You are terse."]), ("user", [0, 1, "Compare."])],
    [("user", ["A", 0, "B", 1, "C", 2])],
    [("user", [0, "Describe it."]), ("assistant", ["A gradient."]), ("user", ["And this one? é 日本語 🙂", 1])],
)


def run_conversations(backend: ImageBackend, count: int) -> None:
    c = case()
    proc = c.families[backend].image
    processor = c.ref_processor[backend]
    rng = np.random.default_rng([SEED, 11])
    pool = [s for s in c.edges + c.randoms if s.width * s.height <= 1_000_000]
    tok = c.tokenizer
    failures: list[str] = []
    for k in range(count):
        turns = CONVERSATIONS[k % len(CONVERSATIONS)]
        n = 1 + max(p for _, parts in turns for p in parts if isinstance(p, int))
        items = [pool[int(i)] for i in rng.choice(len(pool), size=n, replace=False)]
        data = [s.encode() for s in items]
        label = f"conversation {k} [{', '.join(s.label() for s in items)}]"
        pil_images = [Image.open(io.BytesIO(d)) for d in data]
        rendered = processor.apply_chat_template(reference_messages(turns, pil_images), tokenize=False,
                                                 add_generation_prompt=True)
        ref = processor(text=rendered, images=pil_images, return_tensors="np")
        prompt = render_chat(c.bundle.chat_template, template_messages(turns), tok.special_tokens)
        decoded = [decode_image(d, MAX_DECODE_PIXELS) for d in data]
        plans = [proc.plan(im.height, im.width) for im in decoded]
        batch = assemble(proc, plans, [proc.preprocess(im, pl) for im, pl in zip(decoded, plans)])
        ids, _ = splice_all(tok.encode_prompt(prompt), {proc.anchor_token_id: [proc.expand(pl) for pl in plans]})
        ref_ids = ref["input_ids"][0].tolist()
        if prompt != rendered:
            failures.append(f"{label}: rendered prompt differs")
        if ids != ref_ids:
            failures.append(f"{label}: {live.first_difference(ids, ref_ids)}")
        elif not np.array_equal(batch.tensors["pixel_values"], ref["pixel_values"]):
            failures.append(f"{label}: pixel_values differ")
    assert not failures, f"seed={SEED} backend={backend.value}:\n" + "\n".join(failures)


@pytest.mark.parametrize("backend", live.BACKENDS, ids=lambda b: b.value)
def test_expanded_input_ids_and_pixels_equal_the_reference_chat(backend: ImageBackend) -> None:
    run_conversations(backend, 2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", live.BACKENDS, ids=lambda b: b.value)
def test_expanded_input_ids_equal_the_reference_chat_on_many_conversations(backend: ImageBackend) -> None:
    run_conversations(backend, 8)
