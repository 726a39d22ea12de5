"""Tier (b): live differential of the Gemma 3 family against transformers (both image backends).

References (transformers 5.24, bundle ``google--gemma-3-4b-it``):
* ``torchvision``: ``AutoProcessor.from_pretrained(bundle)`` (``Gemma3Processor`` with
  ``Gemma3ImageProcessor``); ``pil``: the same processor built with
  ``AutoImageProcessor.from_pretrained(bundle, backend="pil")`` (``Gemma3ImageProcessorPil``);
* pixels: the image processor called with what ``Gemma3Processor`` passes it
  (``Gemma3Processor.images_kwargs`` overridden by the request's ``mm_processor_kwargs``);
  ``pixel_values`` must be identical (``np.array_equal``) to mmgate's and the reference's
  ``num_crops`` + 1 equal to mmgate's ``num_patches`` (vLLM's key: crops plus the global image)
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

The corpus comparison itself runs in ``test_live_parity.py`` (one test for every family, over
this module's ``LIVE``: cases, corpora, ``compare_one``, ``check_results``; the loop is
``live_support.run_live``); the conversation tests and the checks only this family has are here.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import pytest
from gemma3_support import (
    GEMMA3_BUNDLE,
    PAS_ON,
    options_tuple,
    replacement_ranges,
    substitute_anchors,
    vllm_placeholders,
)
import live_support as live
from parity_support import ImageSpec, reference_messages, template_messages
from PIL import Image

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from mmgate.chat.template import render_chat
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.image import decode_image
from mmgate.models.family import assemble
from mmgate.config.settings import FetchSettings
from mmgate.models.backend import ImageBackend
from mmgate.types import ItemHints

SEED = live.live_seed("gemma3")

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
    return specs + live.mode_specs(seed, lambda j: (700 + 3 * j, 301), lambda j: (61, 97 + 7 * j), (1023, 769))


def random_specs(rng: np.random.Generator, count: int) -> list[ImageSpec]:
    """Log-uniform sides 1..2000; a third of them with the long side 1.1-5x the short one."""
    specs: list[ImageSpec] = []
    while len(specs) < count:
        if len(specs) % 3 == 0:
            short = int(rng.integers(200, 700))
            long = int(short * rng.uniform(1.1, 5.0))
            w, h = (long, short) if rng.random() < 0.5 else (short, long)
        else:
            w, h = (round(math.exp(v)) for v in rng.uniform(0.0, math.log(2000), size=2))
        specs.append(live.random_spec(rng, w, h))
    return specs


def random_options(rng: np.random.Generator) -> dict:
    return {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": int(rng.integers(32, 400)),
            "pan_and_scan_max_num_crops": int(rng.integers(1, 9)),
            "pan_and_scan_min_ratio_to_activate": float(np.round(rng.uniform(0.8, 3.0), 3))}


@dataclass
class Case(live.Reference):
    """The bundle's references (``processors``: per backend) and its corpus."""

    edges: list = field(default_factory=list)
    randoms: list = field(default_factory=list)

    @property
    def processors(self) -> dict:
        return self.ref_processor


@lru_cache(maxsize=1)
def case() -> Case:
    ref = live.load_reference(GEMMA3_BUNDLE, "Gemma3ImageProcessor")
    assert type(ref.ref_processor[ImageBackend.TORCHVISION]).__name__ == "Gemma3Processor"
    return Case(**vars(ref), edges=edge_specs(SEED % 100_000),
                randoms=random_specs(np.random.default_rng(SEED), NUM_RANDOM))


# ---------------------------------------------------------------- comparison (test_live_parity.py runs it)


def compare_one(key: str, backend: ImageBackend, job: live.Job, data: bytes) -> tuple[str, float]:
    """``pixel_values`` identical and ``num_patches`` equal to the reference's ``num_crops`` + 1 with
    the job's ``mm_processor_kwargs``, or both refuse (the reference raises, mmgate answers INVALID_REQUEST)."""
    from transformers import Gemma3Processor

    c = case()
    ref_error: Exception | None = None
    try:
        ref = c.processors[backend].image_processor(images=[Image.open(io.BytesIO(data))],
                                                    **{**Gemma3Processor.images_kwargs, **job.options},
                                                    return_tensors="np")
    except (ValueError, RuntimeError) as exc:
        ref_error = exc
    proc = c.families[backend].image
    hints = ItemHints(options=options_tuple(job.options))
    try:
        proc.check_hints(hints, "messages[0].content[0]")
        decoded = decode_image(data, MAX_DECODE_PIXELS)
        plan = proc.plan(decoded.height, decoded.width, hints)
        batch = assemble(proc, [plan], [proc.preprocess(decoded, plan)])
    except GatewayError as exc:
        if ref_error is not None and exc.code is ErrorCode.INVALID_REQUEST:
            return live.REFUSED, 0.0
        return f"mmgate refused ({exc.code}: {exc}), reference {'refused' if ref_error else 'accepted'}", math.nan
    if ref_error is not None:
        return f"reference failed ({type(ref_error).__name__}: {ref_error}), mmgate accepted", math.nan
    problems, diff = live.tensor_problems(
        {"pixel_values": ref["pixel_values"], "num_patches": np.asarray(ref["num_crops"]) + 1}, batch.tensors)
    return ("; ".join(problems) if problems else live.EQUAL), diff


def jobs(specs: list[ImageSpec], custom_every: int) -> list[live.Job]:
    """Each image with pan-and-scan off and on, and every ``custom_every``-th with random settings."""
    rng = np.random.default_rng([SEED, 7])
    out: list[live.Job] = []
    for k, spec in enumerate(specs):
        option_sets = [{}, PAS_ON] + ([random_options(rng)] if custom_every and k % custom_every == 0 else [])
        out += [live.Job(spec, options) for options in option_sets]
    return out


def check_results(key: str, backend: ImageBackend, results: list[live.Result]) -> None:
    """Some comparisons with pan-and-scan on cut crops."""
    proc = case().families[backend].image
    with_crops = sum(bool(r.job.options) and proc.plan(r.job.spec.height, r.job.spec.width,
                                                       ItemHints(options=options_tuple(r.job.options))).detail[0] > 0
                     for r in results if r.outcome == live.EQUAL)
    print(f"[gemma3 {backend.value}] {with_crops} comparisons with crops")
    assert with_crops > 0


def sample() -> list[ImageSpec]:
    c = case()
    step = max(1, len(c.edges) // NUM_SAMPLE_EDGE)
    return c.edges[::step][:NUM_SAMPLE_EDGE] + c.randoms[:NUM_SAMPLE_RANDOM]


def full_corpus(key: str) -> list[live.Job]:
    c = case()
    assert len(c.randoms) >= 200
    return jobs(c.edges + c.randoms, custom_every=3)


LIVE = live.LiveFamily(
    label="gemma3", keys=("gemma3",), key_id=str, seed=SEED, compare=compare_one, full=full_corpus,
    sample=lambda key: jobs(sample(), custom_every=4), check_results=check_results,
)


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
            failures.append(f"{label}: {live.first_difference(ids, ref_ids)}")
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
