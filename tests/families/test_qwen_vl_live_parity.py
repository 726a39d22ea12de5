"""Tier (b): live differential of the Qwen-VL family against transformers.

For each bundle (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and each reference backend:
* ``torchvision``: ``AutoProcessor.from_pretrained(bundle).image_processor``
  (``Qwen2VLImageProcessor``, what transformers picks when torchvision imports);
* ``pil``: ``AutoImageProcessor.from_pretrained(bundle, backend="pil")``
  (``Qwen2VLImageProcessorPil``);
the same encoded bytes go to mmgate (``decode_image`` -> ``plan`` ->
``preprocess_one`` -> ``assemble``) and to the reference (``PIL.Image.open``),
and ``pixel_values`` / ``image_grid_thw`` must be *identical* (``np.array_equal``).
Images the reference refuses (aspect ratio > 200: ``ValueError``) must be
refused by mmgate with ``image_aspect_ratio_invalid``.

The corpus is fixed edge sizes plus >= 200 random sizes per family, drawn from
a seeded RNG; the seed is printed and can be pinned with ``MMGATE_PARITY_SEED``.
A subset is also rendered into conversations whose expanded ``input_ids`` must
equal the reference processor's ``apply_chat_template(..., tokenize=True)``.

The corpus comparison itself runs in ``test_live_parity.py`` (one test for every family, over
this module's ``LIVE``: cases, corpora, ``compare_one``, ``check_results``; the loop is
``live_support.run_live``); the conversation tests and the checks only this family has are here.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import live_support as live
from parity_support import QWEN_VL_BUNDLES, ImageSpec, openai_messages, reference_messages, splice_anchors
from PIL import Image

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from mmgate.chat.template import render_chat  # noqa: E402
from mmgate.errors import ErrorCode, GatewayError  # noqa: E402
from mmgate.media.image import decode_image  # noqa: E402
from mmgate.models.family import assemble  # noqa: E402
from mmgate.config.settings import FetchSettings  # noqa: E402
from mmgate.models.backend import ImageBackend

pytestmark = pytest.mark.slow

SEED = live.live_seed("qwen-vl")

NUM_RANDOM = 200  # random sizes per family per run, on top of the edge sizes
NUM_LARGE = 3  # of which with sides 1200..2000
MAX_DECODE_PIXELS = FetchSettings().max_image_pixels
BACKENDS = (ImageBackend.PIL, ImageBackend.TORCHVISION)


# ---------------------------------------------------------------- corpus


def edge_specs(factor: int, min_pixels: int, max_pixels: int, seed: int) -> list[ImageSpec]:
    """Fixed edge sizes for one family (``factor`` = patch_size * merge_size)."""
    f = factor
    sizes = [
        (1, 1), (1, 2), (2, 1), (1, 57), (57, 1), (2, 2), (3, 3),
        (f - 1, f - 1), (f, f), (f + 1, f + 1), (f - 1, f + 1), (f + 1, f - 1), (f, f + 1),
        (2 * f - 1, 3 * f + 1), (3 * f + 1, 2 * f - 1),
        # round() is round-half-even: 1.5 -> 2, 2.5 -> 2, 3.5 -> 4
        (f + f // 2, 2 * f + f // 2), (3 * f + f // 2, f + f // 2),
        # aspect ratio 199 / 200 accepted, 200.5 / 201 refused
        (1, 199), (199, 1), (1, 200), (200, 1), (3, 600), (600, 3),
        (1, 201), (201, 1), (2, 401), (401, 2), (3, 603),
    ]
    side = math.isqrt(min_pixels)  # area around min_pixels
    sizes += [(side - 1, side - 1), (side, side), (side + 1, side + 1), (side - f, side + f)]
    big = math.isqrt(max_pixels)  # above max_pixels: downscaled to <= max_pixels
    sizes += [(big + big // 10, big)]
    specs = [ImageSpec(w, h, "RGB", seed + i, name="edge") for i, (w, h) in enumerate(sizes)]
    return specs + live.mode_specs(seed, lambda j: (f + 3 + j, 2 * f + 5), lambda j: (97 + 7 * j, 61), (f + 1, f - 1))


def random_specs(rng: np.random.Generator, count: int, large: int) -> list[ImageSpec]:
    """``count`` random sizes: log-uniform sides 1..1200 (aspect <= 200), ``large`` of them 1200..2000."""
    specs: list[ImageSpec] = []
    while len(specs) < count:
        if len(specs) < large:
            w, h = (int(v) for v in rng.integers(1200, 2001, size=2))
        else:
            w, h = (int(round(math.exp(v))) for v in rng.uniform(0.0, math.log(1200), size=2))
        if max(w, h) / min(w, h) > 200:
            continue
        specs.append(live.random_spec(rng, w, h))
    return specs


_CASES: dict[str, tuple[live.Reference, list[tuple[ImageSpec, bytes]]]] = {}


def family_case(folder: str) -> tuple[live.Reference, list[tuple[ImageSpec, bytes]]]:
    """The bundle's references and its corpus (edge + random sizes), encoded once for every test."""
    if folder in _CASES:
        return _CASES[folder]
    ref = live.load_reference(folder, "Qwen2VLImageProcessor")
    ip = ref.ref_image[ImageBackend.TORCHVISION]
    factor = ip.patch_size * ip.merge_size
    index = QWEN_VL_BUNDLES.index(folder)
    rng = np.random.default_rng([SEED, index])
    specs = edge_specs(factor, ip.size["shortest_edge"], ip.size["longest_edge"], SEED % 100_000 + 1000 * index)
    specs += random_specs(rng, NUM_RANDOM, NUM_LARGE)
    _CASES[folder] = (ref, [(s, s.encode()) for s in specs])
    return _CASES[folder]


# ---------------------------------------------------------------- comparison (test_live_parity.py runs it)


def compare_one(folder: str, backend: ImageBackend, job: live.Job, data: bytes) -> tuple[str, float]:
    """``pixel_values`` and ``image_grid_thw`` identical, or both refuse (aspect ratio > 200)."""
    ref, _ = family_case(folder)
    ref_error: Exception | None = None
    try:
        out = ref.ref_image[backend](images=[Image.open(io.BytesIO(data))], return_tensors="np")
    except ValueError as exc:
        ref_error = exc
    family = ref.families[backend]
    try:
        decoded = decode_image(data, MAX_DECODE_PIXELS)
        plan = family.image.plan(decoded.height, decoded.width)
        batch = assemble(family.image, [plan], [family.image.preprocess(decoded, plan)])
    except GatewayError as exc:
        if ref_error is not None and exc.code is ErrorCode.IMAGE_ASPECT_RATIO_INVALID:
            return live.REFUSED, 0.0
        return f"mmgate refused ({exc.code}: {exc}), reference {'refused: ' + str(ref_error) if ref_error else 'accepted'}", math.nan
    if ref_error is not None:
        return f"reference refused ({ref_error}), mmgate accepted", math.nan
    problems, diff = live.tensor_problems(
        {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}, batch.tensors)
    return ("; ".join(problems) if problems else live.EQUAL), diff


def check_results(folder: str, backend: ImageBackend, results: list[live.Result]) -> None:
    """Every size with max/min side ratio > 200 (arithmetic on the spec) and only those are refused."""
    _, corpus = family_case(folder)
    expected_refused = [s for s, _ in corpus if max(s.width, s.height) / min(s.width, s.height) > 200]
    assert [r.job.spec for r in results if r.outcome == live.REFUSED] == expected_refused
    assert len(corpus) >= NUM_RANDOM + 40


LIVE = live.LiveFamily(
    label="qwen-vl", keys=QWEN_VL_BUNDLES, key_id=lambda folder: folder.split("--")[1], seed=SEED,
    compare=compare_one, full=lambda folder: [live.Job(s, {}, d) for s, d in family_case(folder)[1]], sample=None,
    check_results=check_results,
)


# ---------------------------------------------------------------- conversations

CONVERSATIONS = (
    [("user", [0, "What is in this image?"])],
    [("user", ["Compare ", 0, " with ", 1, "."])],
    [("system", ["You are terse."]), ("user", [0, 1, 2, "Which of the three is brighter? é 日本語 🙂"])],
    [("user", [0, "Describe it."]), ("assistant", ["A gradient."]), ("user", [1, "And this one?"])],
    [("user", ["Picture:\n", 0, "\n\nCount the  spaces\t\tand tabs."])],
)


PARAMS = [pytest.param(folder, be, id=f"{folder.split('--')[1]}-{be.value}") for folder in QWEN_VL_BUNDLES for be in BACKENDS]


@pytest.mark.parametrize(("folder", "backend"), PARAMS)
def test_expanded_input_ids_equal_the_reference_chat_template(folder: str, backend: ImageBackend) -> None:
    case, corpus = family_case(folder)
    family = case.families[backend]
    processor = case.ref_processor[backend]
    pool = [(s, d) for s, d in corpus
            if s.name == "random" and s.width * s.height <= 400_000][:24]
    failures: list[str] = []
    n_images = 0
    for k in range(10):
        turns = CONVERSATIONS[k % len(CONVERSATIONS)]
        count = 1 + max(p for _, parts in turns for p in parts if isinstance(p, int))
        items = [pool[(2 * k + i) % len(pool)] for i in range(count)]
        n_images += count
        labels = ", ".join(s.label() for s, _ in items)
        ref = processor.apply_chat_template(
            reference_messages(turns, [Image.open(io.BytesIO(d)) for _, d in items]),
            tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="np",
        )
        urls = [f"data:image/png;base64,<{i}>" for i in range(count)]  # the template only tests the key
        prompt = render_chat(case.bundle.chat_template, openai_messages(turns, urls), case.tokenizer.special_tokens)
        decoded = [decode_image(d, MAX_DECODE_PIXELS) for _, d in items]
        plans = [family.image.plan(im.height, im.width) for im in decoded]
        batch = assemble(family.image, plans, [family.image.preprocess(im, pl) for im, pl in zip(decoded, plans)])
        ids = splice_anchors(case.tokenizer.encode_prompt(prompt), family.image.image_token_id,
                             [family.image.expand(pl).token_ids for pl in plans])
        ref_ids = ref["input_ids"][0].tolist()
        if ids != ref_ids:
            failures.append(f"conversation {k} [{labels}]: {live.first_difference(ids, ref_ids)}")
        if not np.array_equal(batch.tensors["image_grid_thw"], ref["image_grid_thw"]):
            failures.append(f"conversation {k} [{labels}]: image_grid_thw differs")
        if not np.array_equal(batch.tensors["pixel_values"], ref["pixel_values"]):
            failures.append(f"conversation {k} [{labels}]: pixel_values differ")
    assert not failures, f"seed={SEED} {folder} backend={backend.value}:\n" + "\n".join(failures)
    assert n_images >= 18


# ---------------------------------------------------------------- the two reference resize kernels


def test_pillow_and_torch_bicubic_resizes_disagree_so_each_backend_needs_its_own_kernel() -> None:
    """Why the torchvision backend calls torch's kernel: Pillow's bicubic resize
    (``Qwen2VLImageProcessorPil``) and torch's uint8 antialiased bicubic resize
    (``Qwen2VLImageProcessor``) of the same decoded image are not equal.

    Measured on the Qwen2-VL corpus of this run (images up to 4 Mpx whose
    reference ``smart_resize`` size differs from the original); the printed
    figures are the ones in docs/parity.md.
    """
    import torch
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF
    from transformers.image_transforms import convert_to_rgb
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    case, corpus = family_case(QWEN_VL_BUNDLES[0])
    ip = case.ref_image[ImageBackend.TORCHVISION]
    factor = ip.patch_size * ip.merge_size
    values = differing = above_one = worst = 0
    per_image: list[float] = []
    for spec, data in corpus:
        if max(spec.width, spec.height) / min(spec.width, spec.height) > 200 or spec.width * spec.height > 4_000_000:
            continue
        rgb = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
        h, w = smart_resize(rgb.shape[0], rgb.shape[1], factor, ip.size["shortest_edge"], ip.size["longest_edge"])
        if (h, w) == rgb.shape[:2]:
            continue
        by_pil = np.asarray(Image.fromarray(rgb).resize((w, h), resample=Image.Resampling.BICUBIC)).astype(np.int16)
        tensor = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)
        by_torch = tvF.resize(tensor, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True)
        delta = np.abs(by_pil - by_torch.permute(1, 2, 0).numpy().astype(np.int16))
        values += delta.size
        differing += int(np.count_nonzero(delta))
        above_one += int(np.count_nonzero(delta > 1))
        worst = max(worst, int(delta.max()))
        per_image.append(float(np.count_nonzero(delta)) / delta.size)
    n_differ = sum(f > 0 for f in per_image)
    print(f"[resize kernels] seed={SEED}: {len(per_image)} resized images, {n_differ} differ; "
          f"{differing / values:.3%} of uint8 values differ ({above_one / values:.4%} by more than 1); "
          f"max |pil - torch| = {worst}; per-image share of differing values: median {np.median(per_image):.3%}, "
          f"max {max(per_image):.1%}")
    assert len(per_image) >= 100
    assert n_differ > 0, "Pillow and torch now agree: the torchvision backend could use Pillow"
