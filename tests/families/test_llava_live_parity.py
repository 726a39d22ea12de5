"""Tier (b): live differential of the LLaVA-1.5 and LLaVA-NeXT families against transformers.

References (transformers 5.24), per bundle and image backend:
* ``torchvision``: ``AutoProcessor.from_pretrained(bundle)`` (``LlavaProcessor`` with
  ``CLIPImageProcessor``; ``LlavaNextProcessor`` with ``LlavaNextImageProcessor``); ``pil``: the
  same processor built with ``AutoImageProcessor.from_pretrained(bundle, backend="pil")``
  (``CLIPImageProcessorPil``, ``LlavaNextImageProcessorPil``);
* pixels: the image processor on ``PIL.Image.open(bytes)``; ``pixel_values`` (and NeXT's
  ``image_sizes``) must be identical (``np.array_equal``, max |diff| reported) to mmgate's
  (``decode_image`` -> ``plan`` -> ``preprocess`` -> ``mmgate.models.family.assemble``), and the
  token count ``processor.replace_image_token(output, 0)`` gives equal to ``plan.num_tokens``;
* prompts: ``processor(text=processor.apply_chat_template(messages, tokenize=False,
  add_generation_prompt=True), images=...)``; mmgate's render (``{"type": "image"}`` parts) +
  ``BundleTokenizer.encode_prompt`` + ``splice_all`` of ``expand(plan)`` must give the same ids,
  each placeholder range one whole ``<image>`` run, and the batch the same (zero-padded)
  ``pixel_values`` / ``image_sizes``.

Corpus: edge sizes (1x1, thin strips 1xN / Nx1, extreme aspect ratios up to LLaVA-1.5's resize
bound and past it, every image mode, JPEG, and for NeXT every anyres pinpoint with its +-1
neighbours, half and double) plus random sizes from a seeded RNG (``MMGATE_PARITY_SEED`` pins it;
printed).  The default run takes a sample of about 20 sizes per family and backend and a few
conversations; the ``slow`` tests take every edge size, >= 200 random sizes per family and 24
conversations.  Images past LLaVA-1.5's ``MAX_RESIZED_PIXELS`` are refused by mmgate (the
reference would resize them), checked by arithmetic, not run through the reference.

The corpus comparison itself runs in ``test_live_parity.py`` (one test for every family, over
this module's ``LIVE``: cases, corpora, ``compare_one``, ``check_results``; the loop is
``live_support.run_live``); the conversation tests and the checks only this family has are here.
"""

from __future__ import annotations

import io
import math
from functools import cache

import numpy as np
import pytest
import live_support as live
from parity_support import MODES, ImageSpec, reference_messages, template_messages, whole_runs
from PIL import Image

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from mmgate.chat.template import render_chat
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.image import decode_image
from mmgate.models.family import assemble
from mmgate.models.llava import MAX_RESIZED_PIXELS, LlavaFamily, shortest_edge_size
from mmgate.models.llava_next import LlavaNextFamily
from mmgate.pipeline.planning import splice_all
from mmgate.config.settings import FetchSettings
from mmgate.models.backend import ImageBackend

SEED = live.live_seed("llava")

BUNDLES = {"llava": "llava-hf--llava-1.5-7b-hf", "llava_next": "llava-hf--llava-v1.6-mistral-7b-hf"}
FAMILY_CLASSES = {"llava": LlavaFamily, "llava_next": LlavaNextFamily}
NUM_RANDOM = 200  # random sizes per family per slow run, on top of the edge sizes
MAX_DECODE_PIXELS = FetchSettings().max_image_pixels
BACKENDS = (ImageBackend.PIL, ImageBackend.TORCHVISION)
PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))  # (h, w), both bundles' anyres grid

#: the default run's sample (width, height, mode): tiny, strips, aspect extremes, every mode, pinpoint edges
SAMPLE = (
    (1, 1, "RGB"), (1, 57, "L"), (57, 1, "RGB"), (3, 600, "RGB"), (600, 3, "RGBA"), (1, 200, "RGB"), (595, 1, "RGB"),
    (640, 480, "RGB"), (335, 337, "LA"), (336, 336, "P"), (337, 335, "P+tRNS"), (27, 29, "P+alpha"),
    (97, 61, "RGBA"), (672, 336, "RGB"), (673, 336, "RGB"), (671, 335, "L"), (336, 1009, "RGB"),
    (336, 1008, "RGB"), (673, 673, "RGB"), (1009, 337, "RGB"), (2048, 1536, "RGB"),
)


# ---------------------------------------------------------------- corpus


def sample_specs(seed: int) -> list[ImageSpec]:
    return [ImageSpec(w, h, mode, seed + i, name="sample") for i, (w, h, mode) in enumerate(SAMPLE)]


def edge_specs(seed: int) -> list[ImageSpec]:
    sizes = [  # (width, height)
        (1, 1), (1, 2), (2, 1), (2, 2), (3, 3), (1, 57), (57, 1), (1, 336), (336, 1), (1, 594), (594, 1),
        (1, 595), (595, 1), (2, 1189), (1189, 2), (3, 2000), (2000, 3), (1, 5000),  # 595+, 1189+: past the bound
        (335, 335), (336, 336), (337, 337), (335, 337), (337, 335), (336, 337), (448, 336), (336, 448),
        (1, 200), (200, 1), (7, 1500), (1500, 7), (2048, 1536), (1536, 2048), (4000, 3000),
    ]
    for ph, pw in PINPOINTS:  # every anyres pinpoint, its +-1 neighbours, half and double
        sizes += [(pw + dw, ph + dh) for dh in (-1, 0, 1) for dw in (-1, 0, 1)]
        sizes += [(pw // 2, ph // 2), (pw // 2 + 1, ph // 2), (pw * 2, ph * 2), (pw * 2 + 1, ph * 2 - 1)]
    specs = [ImageSpec(w, h, "RGB", seed + i, name="edge") for i, (w, h) in enumerate(sizes)]
    return specs + live.mode_specs(seed, lambda j: (350 + 3 * j, 301), lambda j: (61, 97 + 7 * j), (1023, 769))


def random_specs(rng: np.random.Generator, count: int) -> list[ImageSpec]:
    """Log-uniform sides 1..2000 (aspect <= 200); a third near the pinpoint aspect ratios 1:1, 1:2, 1:3."""
    specs: list[ImageSpec] = []
    while len(specs) < count:
        if len(specs) % 3 == 0:
            short = int(rng.integers(100, 1100))
            long = max(short, round(short * int(rng.integers(1, 4)) * float(rng.uniform(0.9, 1.1))))
            w, h = (long, short) if rng.random() < 0.5 else (short, long)
        else:
            w, h = (round(math.exp(v)) for v in rng.uniform(0.0, math.log(2000), size=2))
            if max(w, h) / min(w, h) > 200:
                continue
        specs.append(live.random_spec(rng, w, h))
    return specs


@cache
def case_for(name: str) -> live.Reference:
    image_processor = {"llava": "CLIPImageProcessor", "llava_next": "LlavaNextImageProcessor"}[name]
    return live.load_reference(BUNDLES[name], image_processor, FAMILY_CLASSES[name].from_bundle)


# ---------------------------------------------------------------- comparison


def past_bound(name: str, spec: ImageSpec) -> bool:
    """LLaVA-1.5's refusal, by arithmetic: the shortest-edge resize exceeds ``MAX_RESIZED_PIXELS``."""
    if name != "llava":
        return False
    rh, rw = shortest_edge_size(spec.height, spec.width, 336)
    return rh * rw > MAX_RESIZED_PIXELS


def compare_one(name: str, backend: ImageBackend, job: live.Job, data: bytes) -> tuple[str, float]:
    """``pixel_values`` (NeXT: and ``image_sizes``) identical and the token count the processor's
    ``replace_image_token`` gives; images past LLaVA-1.5's resize bound refused, not run."""
    case = case_for(name)
    proc = case.families[backend].image
    try:
        decoded = decode_image(data, MAX_DECODE_PIXELS)
        plan = proc.plan(decoded.height, decoded.width)
    except GatewayError as exc:
        if past_bound(name, job.spec) and exc.code is ErrorCode.IMAGE_ASPECT_RATIO_INVALID:
            return live.REFUSED, 0.0
        return f"mmgate refused ({exc.code}: {exc})", math.nan
    if past_bound(name, job.spec):
        return "mmgate accepted an image past the resize bound", math.nan
    batch = assemble(proc, [plan], [proc.preprocess(decoded, plan)])
    ref = case.ref_image[backend](images=[Image.open(io.BytesIO(data))], return_tensors="np")
    wanted = {k: ref[k] for k in ("pixel_values", "image_sizes") if k in ref}
    problems, diff = live.tensor_problems(wanted, batch.tensors, same_dtype=("image_sizes",))
    processor = case.ref_processor[backend]
    tokens = len(processor.replace_image_token(ref, 0)) // len(processor.image_token)
    if tokens != plan.num_tokens:
        problems.append(f"{plan.num_tokens} image tokens, reference {tokens}")
    return ("; ".join(problems) if problems else live.EQUAL), diff


def check_results(name: str, backend: ImageBackend, results: list[live.Result]) -> None:
    """Refused: exactly the images past the resize bound (by arithmetic)."""
    assert [r.job.spec for r in results if r.outcome == live.REFUSED] == [r.job.spec for r in results
                                                                      if past_bound(name, r.job.spec)]


def full_corpus(name: str) -> list[live.Job]:
    index = list(BUNDLES).index(name)
    specs = edge_specs(SEED % 100_000 + 1000 * index) + random_specs(np.random.default_rng([SEED, index]), NUM_RANDOM)
    assert sum(s.name == "random" for s in specs) >= 200
    return [live.Job(s) for s in specs]


LIVE = live.LiveFamily(
    label="llava", keys=tuple(BUNDLES), key_id=str, seed=SEED, compare=compare_one, full=full_corpus,
    sample=lambda name: [live.Job(s) for s in sample_specs(SEED % 100_000)], check_results=check_results,
)
PARAMS = [pytest.param(name, be, id=f"{name}-{be.value}") for name in BUNDLES for be in BACKENDS]


# ---------------------------------------------------------------- conversations

CONVERSATIONS = (
    [("user", [0, "What is in this image?"])],
    [("user", ["Compare ", 0, " with ", 1, "."])],
    [("user", [0, 1, 2, "Which of the three is brighter? é 日本語 🙂"])],
    [("user", ["Describe ", 0, " please."]), ("assistant", ["A gradient."]), ("user", [1, "And this one?"])],
    [("user", ["Picture:\n", 0, "\n\nCount the  spaces\t\tand tabs."])],
    [("user", ["Three: ", 0, " / ", 1, " / ", 2]), ("assistant", ["Noted."]), ("user", ["Which is widest?"])],
)


def run_conversations(name: str, backend: ImageBackend, count: int, seed: int) -> None:
    case = case_for(name)
    proc = case.families[backend].image
    processor = case.ref_processor[backend]
    rng = np.random.default_rng(seed)
    failures: list[str] = []
    n_images = 0
    for k in range(count):
        turns = CONVERSATIONS[k % len(CONVERSATIONS)]
        n = 1 + max(p for _, parts in turns for p in parts if isinstance(p, int))
        specs = []
        while len(specs) < n:  # sizes spread over the pinpoints (different tile counts in one batch)
            w, h = (int(v) for v in rng.integers(1, 1400, size=2))
            if max(w, h) / min(w, h) > 200:  # as random_specs; LLaVA-1.5 refuses past ~594 (compare_one checks it)
                continue
            specs.append(ImageSpec(w, h, str(rng.choice(("RGB", "RGB", *MODES))), int(rng.integers(0, 2**31))))
        n_images += n
        datas = [s.encode() for s in specs]
        prompt = processor.apply_chat_template(reference_messages(turns, [Image.open(io.BytesIO(d)) for d in datas],
                                                                  flatten_text_turns=False),
                                               tokenize=False, add_generation_prompt=True)
        ref = processor(text=prompt, images=[Image.open(io.BytesIO(d)) for d in datas], return_tensors="np")
        mine = render_chat(case.bundle.chat_template, template_messages(turns, flatten_text_turns=False),
                           case.tokenizer.special_tokens)
        decoded = [decode_image(d, MAX_DECODE_PIXELS) for d in datas]
        plans = [proc.plan(im.height, im.width) for im in decoded]
        ids, ranges = splice_all(case.tokenizer.encode_prompt(mine), {proc.anchor_token_id: [proc.expand(p) for p in plans]})
        batch = assemble(proc, plans, [proc.preprocess(im, pl) for im, pl in zip(decoded, plans)])
        labels = ", ".join(s.label() for s in specs)
        ref_ids = ref["input_ids"][0].tolist()
        if mine != prompt:
            failures.append(f"conversation {k}: rendered prompt differs")
        if ids != ref_ids:
            failures.append(f"conversation {k} [{labels}]: {live.first_difference(ids, ref_ids)}")
        if [(r.offset, r.length) for r in ranges[proc.anchor_token_id]] != whole_runs(ref_ids, proc.placeholder_token_id):
            failures.append(f"conversation {k} [{labels}]: placeholder ranges are not the <image> runs")
        if live.max_abs_diff(np.asarray(ref["pixel_values"]), batch.tensors["pixel_values"]) != 0.0:
            failures.append(f"conversation {k} [{labels}]: batched pixel_values differ")
        if "image_sizes" in ref and not np.array_equal(ref["image_sizes"], batch.tensors["image_sizes"]):
            failures.append(f"conversation {k} [{labels}]: image_sizes differ")
    assert not failures, f"seed={SEED} {name} backend={backend.value}:\n" + "\n".join(failures)
    assert n_images >= count


@pytest.mark.parametrize(("name", "backend"), PARAMS)
def test_expanded_input_ids_ranges_and_batch_equal_the_reference_chat(name: str, backend: ImageBackend) -> None:
    run_conversations(name, backend, 3, SEED + 7)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "backend"), PARAMS)
def test_expanded_input_ids_equal_the_reference_chat_on_many_conversations(name: str, backend: ImageBackend) -> None:
    run_conversations(name, backend, 24, SEED + 11)


# ---------------------------------------------------------------- a crop larger than the resized image


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_a_crop_larger_than_the_resized_image_pads_where_each_backend_pads(backend: ImageBackend) -> None:
    """Not reachable with the bundles (the crop equals the short side), but the port covers it:
    ``CLIPImageProcessor`` pads at ``(crop - size) // 2``, ``CLIPImageProcessorPil`` at the ceiling."""
    from transformers.models.clip.image_processing_clip import CLIPImageProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from mmgate.models.llava import ClipCropImages, ImageTokens, clip_params

    cfg = {"size": {"shortest_edge": 300}, "crop_size": {"height": 337, "width": 301}}
    ref_ip = (CLIPImageProcessor if backend is ImageBackend.TORCHVISION else CLIPImageProcessorPil)(**cfg)
    proc = ClipCropImages("llava", clip_params(cfg, "test"), ImageTokens("<image>", 32000, 14, 1, "default"), backend)
    for w, h in ((300, 300), (301, 300), (500, 300), (300, 500), (10, 11), (600, 299)):
        data = ImageSpec(w, h, "RGB", w * h).encode()
        ref = np.asarray(ref_ip(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"])[0]
        decoded = decode_image(data, MAX_DECODE_PIXELS)
        plan = proc.plan(decoded.height, decoded.width)
        assert live.max_abs_diff(ref, proc.preprocess(decoded, plan)) == 0.0, f"{w}x{h} {backend.value}"
        assert plan.num_tokens == (337 // 14) * (301 // 14)
