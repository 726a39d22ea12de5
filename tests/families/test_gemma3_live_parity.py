"""Tier (b): live differential of the Gemma 3 family against transformers (both image backends).

References (transformers 5.24, bundle ``google--gemma-3-4b-it``):
* ``torchvision``: ``AutoProcessor.from_pretrained(bundle)`` (``Gemma3Processor`` with
  ``Gemma3ImageProcessor``); ``pil``: the same processor built with
  ``AutoImageProcessor.from_pretrained(bundle, backend="pil")`` (``Gemma3ImageProcessorPil``);
* pixels: the image processor called with what ``Gemma3Processor`` passes it
  (``Gemma3Processor.images_kwargs`` overridden by the request's ``mm_processor_kwargs``);
  ``pixel_values`` and ``num_crops`` must be identical (``np.array_equal``) to mmgate's
  (``decode_image`` -> ``plan`` -> ``preprocess`` -> ``assemble``), pan-and-scan off, on, and
  with random custom settings; settings the reference fails on must be refused (INVALID_REQUEST);
* prompts: ``processor.apply_chat_template(tokenize=False)`` then ``processor(text=prompt,
  images=..., add_special_tokens=False, **mm_processor_kwargs)``; the rendered prompt with each
  ``<start_of_image>`` replaced by ``expand(plan).text`` and tokenized by mmgate must give the
  same ids, the batch the same ``pixel_values``, and the ``Replacement`` ranges the ranges vLLM's
  ``_find_mm_placeholders`` finds.

The corpus: edge sizes (1x1, thin strips, extreme aspect ratios, the crop activation ratio and the
minimum crop size from both sides, every image mode, JPEG) and random sizes from a seeded RNG
(``MMGATE_PARITY_SEED`` pins it; printed).  The default run takes a representative sample of about
20 sizes per backend; the ``slow`` tests take every edge size and >= 200 random sizes.
"""

from __future__ import annotations

import io
import math
import os
import secrets
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from gemma3_support import (
    GEMMA3_BUNDLE,
    PAS_ON,
    options_tuple,
    reference_messages,
    replacement_ranges,
    substitute_anchors,
    template_messages,
    vllm_placeholders,
)
from parity_support import MODES, ImageSpec, find_bundle_dir
from PIL import Image

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from mmgate.chat.template import render_chat
from mmgate.chat.tokenizer import load_tokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.image import decode_image
from mmgate.models.bundle import load_bundle
from mmgate.models.family import assemble
from mmgate.models.registry import load_family
from mmgate.config.settings import FetchSettings
from mmgate.models.backend import ImageBackend
from mmgate.types import ItemHints

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SEED = int(os.environ.get("MMGATE_PARITY_SEED") or secrets.randbits(32))
print(f"\n[gemma3 live parity] seed={SEED} (rerun with MMGATE_PARITY_SEED={SEED})")

NUM_RANDOM = 200  # random sizes per slow run, on top of the edge sizes
NUM_SAMPLE_EDGE, NUM_SAMPLE_RANDOM = 12, 8  # the default run's sample
MAX_DECODE_PIXELS = FetchSettings().max_image_pixels
BACKENDS = (ImageBackend.PIL, ImageBackend.TORCHVISION)


# ---------------------------------------------------------------- corpus


def edge_specs(seed: int) -> list[ImageSpec]:
    sizes = [  # (width, height)
        (1, 1), (1, 2), (2, 1), (1, 57), (57, 1), (3, 2000), (2000, 3), (1, 1999), (1999, 1), (7, 1500),
        (896, 896), (895, 897), (897, 895), (1792, 896), (896, 1792), (2688, 896),
        (600, 500), (599, 500), (500, 600), (500, 599), (934, 777), (933, 777),  # activation ratio 1.2
        (511, 400), (510, 400), (400, 511), (400, 510), (1024, 256), (1024, 255),  # minimum crop side 256
        (1000, 400), (999, 400), (400, 1000),  # ratio 2.5 rounds half up
        (2000, 300), (300, 2000), (1600, 400),  # capped at 4 crops
        (1001, 300), (1027, 256),  # uneven last crop
    ]
    specs = [ImageSpec(w, h, "RGB", seed + i, name="edge") for i, (w, h) in enumerate(sizes)]
    for j, mode in enumerate(MODES):
        specs.append(ImageSpec(700 + 3 * j, 301, mode, seed + 100 + j, name="mode"))
        specs.append(ImageSpec(61, 97 + 7 * j, mode, seed + 200 + j, name="mode"))
    specs += [ImageSpec(1023, 769, m, seed + 300 + k, "JPEG", name="jpeg") for k, m in enumerate(("RGB", "L"))]
    return specs


def random_specs(rng: np.random.Generator, count: int) -> list[ImageSpec]:
    """Log-uniform sides 1..2000; a third of them with the long side 1.1-5x the short one."""
    specs: list[ImageSpec] = []
    modes = ("RGB",) * 6 + MODES
    while len(specs) < count:
        if len(specs) % 3 == 0:
            short = int(rng.integers(200, 700))
            long = int(short * rng.uniform(1.1, 5.0))
            w, h = (long, short) if rng.random() < 0.5 else (short, long)
        else:
            w, h = (round(math.exp(v)) for v in rng.uniform(0.0, math.log(2000), size=2))
        mode = str(rng.choice(modes))
        fmt = "JPEG" if mode in ("RGB", "L") and rng.random() < 0.2 else "PNG"
        specs.append(ImageSpec(w, h, mode, int(rng.integers(0, 2**31)), fmt, name="random"))
    return specs


def random_options(rng: np.random.Generator) -> dict:
    return {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": int(rng.integers(32, 400)),
            "pan_and_scan_max_num_crops": int(rng.integers(1, 9)),
            "pan_and_scan_min_ratio_to_activate": float(np.round(rng.uniform(0.8, 3.0), 3))}


@dataclass
class Case:
    bundle: object
    tokenizer: object
    families: dict
    processors: dict  # backend -> Gemma3Processor with that backend's image processor
    edges: list
    randoms: list


@lru_cache(maxsize=1)
def case() -> Case:
    path = find_bundle_dir(GEMMA3_BUNDLE)
    if path is None:
        pytest.skip(f"model bundle {GEMMA3_BUNDLE} not on MMGATE_MODEL_PATH / ../shared/models")
    from transformers import AutoImageProcessor, AutoProcessor

    bundle = load_bundle(Path(path))
    tok = load_tokenizer(bundle)
    processor = AutoProcessor.from_pretrained(str(path))
    pil_ip = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    assert type(processor.image_processor).__name__ == "Gemma3ImageProcessor"
    assert type(pil_ip).__name__ == "Gemma3ImageProcessorPil"
    rng = np.random.default_rng(SEED)
    return Case(bundle=bundle, tokenizer=tok, families={be: load_family(bundle, tok, be) for be in BACKENDS},
                processors={ImageBackend.TORCHVISION: processor,
                            ImageBackend.PIL: AutoProcessor.from_pretrained(str(path), image_processor=pil_ip)},
                edges=edge_specs(SEED % 100_000), randoms=random_specs(rng, NUM_RANDOM))


# ---------------------------------------------------------------- comparison


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return math.nan
    if np.array_equal(a, b):
        return 0.0
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def compare_one(c: Case, backend: ImageBackend, spec: ImageSpec, data: bytes, options: dict) -> tuple[str, float]:
    """('equal' | 'both_refused' | a mismatch description, max |diff|)."""
    from transformers import Gemma3Processor

    ref_error: Exception | None = None
    try:
        ref = c.processors[backend].image_processor(images=[Image.open(io.BytesIO(data))],
                                                    **{**Gemma3Processor.images_kwargs, **options},
                                                    return_tensors="np")
    except (ValueError, RuntimeError) as exc:
        ref_error = exc
    proc = c.families[backend].image
    hints = ItemHints(options=options_tuple(options))
    try:
        proc.check_hints(hints, "messages[0].content[0]")
        decoded = decode_image(data, MAX_DECODE_PIXELS)
        plan = proc.plan(decoded.height, decoded.width, hints)
        batch = assemble(proc, [plan], [proc.preprocess(decoded, plan)])
    except GatewayError as exc:
        if ref_error is not None and exc.code is ErrorCode.INVALID_REQUEST:
            return "both_refused", 0.0
        return f"mmgate refused ({exc.code}: {exc}), reference {'refused' if ref_error else 'accepted'}", math.nan
    if ref_error is not None:
        return f"reference failed ({type(ref_error).__name__}: {ref_error}), mmgate accepted", math.nan
    ref_pv, pv = np.asarray(ref["pixel_values"]), batch.tensors["pixel_values"]
    diff = _max_abs_diff(ref_pv, pv)
    problems = []
    if ref_pv.shape != pv.shape or ref_pv.dtype != pv.dtype:
        problems.append(f"pixel_values {pv.dtype}{pv.shape} != reference {ref_pv.dtype}{ref_pv.shape}")
    if list(np.asarray(ref["num_crops"])) != batch.tensors["num_crops"].tolist():
        problems.append(f"num_crops {batch.tensors['num_crops'].tolist()} != {list(ref['num_crops'])}")
    if not problems and diff != 0.0:
        problems.append(f"pixel_values differ: max |diff| {diff:.3g} on {float(np.mean(ref_pv != pv)):.4%}")
    return ("; ".join(problems) if problems else "equal"), diff


def run_corpus(backend: ImageBackend, specs: list[ImageSpec], custom_every: int) -> None:
    c = case()
    rng = np.random.default_rng([SEED, 7])
    t0 = time.perf_counter()
    mismatches: list[str] = []
    worst, runs, refused, with_crops = 0.0, 0, 0, 0
    for k, spec in enumerate(specs):
        data = spec.encode()
        option_sets = [{}, PAS_ON] + ([random_options(rng)] if custom_every and k % custom_every == 0 else [])
        for options in option_sets:
            outcome, diff = compare_one(c, backend, spec, data, options)
            runs += 1
            if outcome == "both_refused":
                refused += 1
            elif outcome != "equal":
                mismatches.append(f"{spec.label()} options={options}: {outcome}")
            else:
                worst = max(worst, diff)
                with_crops += bool(options) and c.families[backend].image.plan(
                    spec.height, spec.width, ItemHints(options=options_tuple(options))).detail[0] > 0
    print(f"[gemma3 {backend.value}] {len(specs)} images, {runs} comparisons ({with_crops} with crops, {refused} "
          f"refused by both), max |diff| = {worst}, {time.perf_counter() - t0:.1f}s")
    assert not mismatches, (f"seed={SEED} backend={backend.value}: {len(mismatches)} of {runs} comparisons differ:\n"
                            + "\n".join(mismatches))
    assert worst == 0.0 and with_crops > 0


def sample() -> list[ImageSpec]:
    c = case()
    step = max(1, len(c.edges) // NUM_SAMPLE_EDGE)
    return c.edges[::step][:NUM_SAMPLE_EDGE] + c.randoms[:NUM_SAMPLE_RANDOM]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_pixel_values_equal_the_reference_on_a_sample(backend: ImageBackend) -> None:
    run_corpus(backend, sample(), custom_every=4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_pixel_values_equal_the_reference_on_edge_and_random_images(backend: ImageBackend) -> None:
    c = case()
    assert len(c.randoms) >= 200
    run_corpus(backend, c.edges + c.randoms, custom_every=3)


# ---------------------------------------------------------------- conversations

CONVERSATIONS = (
    [("user", ["look:\n", 0, "\nnow"])],
    [("system", ["You are terse."]), ("user", [0, 1, "Compare."])],  # "\n\n" + "\n\n" and two adjacent images
    [("system", ["Rules:\n"]), ("user", [0, "What is it?"])],  # five newlines before the first image
    [("user", ["A", 0, "B", 1, "C", 2])],
    [("user", [0, "Describe it."]), ("assistant", ["A gradient."]), ("user", ["And this one? é 日本語 🙂", 1])],
    [("user", ["first line\n\nsecond:", 0, "tail\n\n\nmore"])],
    [("user", [0])],
)


def run_conversations(backend: ImageBackend, count: int) -> None:
    c = case()
    proc = c.families[backend].image
    processor = c.processors[backend]
    rng = np.random.default_rng([SEED, 11])
    pool = [s for s in c.edges + c.randoms if s.width * s.height <= 1_500_000]
    tok = c.tokenizer
    newlines = tuple(tok.token_id(t) for t in ("\n", "\n\n", "\n\n\n", "\n\n\n\n"))
    failures: list[str] = []
    n_images = compared = 0
    for k in range(count):
        turns = CONVERSATIONS[k % len(CONVERSATIONS)]
        n = 1 + max(p for _, parts in turns for p in parts if isinstance(p, int))
        items = [pool[int(i)] for i in rng.choice(len(pool), size=n, replace=False)]
        data = [s.encode() for s in items]
        options = ({}, PAS_ON, random_options(rng))[k % 3]
        n_images += n
        label = f"conversation {k} options={options} [{', '.join(s.label() for s in items)}]"
        pil_images = [Image.open(io.BytesIO(d)) for d in data]
        rendered = processor.apply_chat_template(reference_messages(turns, pil_images), tokenize=False,
                                                 add_generation_prompt=True)
        try:
            ref = processor(text=rendered, images=pil_images, add_special_tokens=False, **options,
                            return_tensors="np")
        except (ValueError, RuntimeError):
            continue  # random settings the reference fails on: the single-image tier checks the refusal
        prompt = render_chat(c.bundle.chat_template, template_messages(turns), tok.special_tokens)
        hints = ItemHints(options=options_tuple(options))
        decoded = [decode_image(d, MAX_DECODE_PIXELS) for d in data]
        plans = [proc.plan(im.height, im.width, hints) for im in decoded]
        batch = assemble(proc, plans, [proc.preprocess(im, pl) for im, pl in zip(decoded, plans)])
        reps = [proc.expand(pl) for pl in plans]
        ids = tok.encode_prompt(substitute_anchors(prompt, [r.text for r in reps]))
        ref_ids = ref["input_ids"][0].tolist()
        if prompt != rendered:
            failures.append(f"{label}: rendered prompt differs")
        if ids != ref_ids:
            first = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), min(len(ids), len(ref_ids)))
            failures.append(f"{label}: input_ids differ at {first} (len {len(ids)} vs reference {len(ref_ids)})")
            continue
        compared += 1
        if not np.array_equal(batch.tensors["pixel_values"], ref["pixel_values"]):
            failures.append(f"{label}: pixel_values differ")
        ranges = replacement_ranges(ids, proc.placeholder_token_id,
                                    [(r.embed_offset, r.embed_length, r.trail) for r in reps])
        expected = vllm_placeholders(ids, [tok.tokenizer.encode(r.text, add_special_tokens=False).ids for r in reps],
                                     newlines)
        if expected is not None and ranges != expected:
            failures.append(f"{label}: placeholder ranges {ranges} != vLLM's {expected}")
        if k == 0:  # the plain processor call adds a second <bos>; apply_chat_template(tokenize=True) does not
            doubled = processor(text=rendered, images=pil_images, **options)["input_ids"][0]
            assert list(doubled) == [ids[0]] + ids
            if not options:
                tokenized = processor.apply_chat_template(reference_messages(turns, pil_images), tokenize=True,
                                                          return_dict=True, add_generation_prompt=True)
                assert list(tokenized["input_ids"][0]) == ids
    assert not failures, f"seed={SEED} backend={backend.value}:\n" + "\n".join(failures)
    print(f"[gemma3 {backend.value}] {compared} of {count} conversations compared ({n_images} images)")
    assert n_images >= count and compared >= count - count // 3


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_expanded_input_ids_pixels_and_ranges_equal_the_reference_chat(backend: ImageBackend) -> None:
    run_conversations(backend, 4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_expanded_input_ids_equal_the_reference_chat_on_many_conversations(backend: ImageBackend) -> None:
    run_conversations(backend, 21)


def test_settings_that_cut_an_empty_crop_are_refused_where_the_torchvision_reference_fails() -> None:
    """W=6, H=1 with ``pan_and_scan_min_crop_size`` 1: crops of 2 at 0, 2, 4, 6, the last empty.
    ``Gemma3ImageProcessor`` raises (RuntimeError reshaping the empty resize); mmgate refuses
    (INVALID_REQUEST).  ``Gemma3ImageProcessorPil`` instead returns a black tile (-1.0) for the empty
    crop: the one deliberate difference from the PIL reference (docs)."""
    from transformers import Gemma3Processor

    c = case()
    options = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 1}
    image = Image.fromarray(np.full((1, 6, 3), 200, dtype=np.uint8))
    kwargs = {**Gemma3Processor.images_kwargs, **options}
    with pytest.raises(RuntimeError):
        c.processors[ImageBackend.TORCHVISION].image_processor(images=[image], **kwargs)
    pil = c.processors[ImageBackend.PIL].image_processor(images=[image], **kwargs, return_tensors="np")
    assert list(pil["num_crops"]) == [4] and np.all(pil["pixel_values"][4] == -1.0)
    for backend in BACKENDS:
        with pytest.raises(GatewayError) as info:
            c.families[backend].image.plan(1, 6, ItemHints(options=options_tuple(options)))
        assert info.value.code is ErrorCode.INVALID_REQUEST
