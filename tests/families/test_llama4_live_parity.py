"""Tier (b): live differential of the Llama 4 family against transformers.

Reference (transformers 5.24): ``AutoProcessor.from_pretrained(bundle)`` = ``Llama4Processor`` with
``Llama4ImageProcessor``, the one (torchvision) backend transformers has for Llama 4; mmgate is
exact to it whatever ``--image-backend`` says, so both mmgate backends are compared with it.
* pixels: the image processor on ``PIL.Image.open(bytes)``; ``pixel_values`` (bfloat16 there, as
  float32 here) and ``aspect_ratios`` identical to mmgate's (``decode_image`` -> ``plan`` ->
  ``preprocess`` -> ``assemble``), ``patches_per_image`` the reference's tile count, and the ids of
  ``processor.replace_image_token(output, 0)`` equal to ``expand(plan).token_ids``;
* geometry: at every tiling boundary (each canvas of at most 16 tiles, exactly and one pixel on
  either side of each edge) and over a dense grid of sizes, the canvas and resize size of
  ``get_best_fit`` / ``get_max_res_without_distortion`` equal ``plan``'s (arithmetic only, cheap);
* prompts: ``processor.apply_chat_template(messages, tokenize=True, return_dict=True)`` against
  mmgate's render + ``encode_prompt`` + ``splice_all``, each placeholder range the whole run.

Corpus: edge sizes (1x1, strips, each canvas's exact size with a pixel more on one side, 16 tiles
and past, every image mode, JPEG) plus random sizes from a seeded RNG (``MMGATE_PARITY_SEED``
pins it; printed), mostly small (log-uniform up to 1400 px) to keep the tier cheap.  The default
run takes a sample of about 20 sizes; the ``slow`` test takes the edge sizes and >= 200 random
sizes.  The corpus loop runs in ``test_live_parity.py`` over :data:`LIVE`.
"""

from __future__ import annotations

import io
import math
from functools import cache
from pathlib import Path

import live_support as live
import numpy as np
import pytest
from parity_support import MODES, ImageSpec, find_bundle_dir, reference_messages, template_messages
from PIL import Image

transformers = pytest.importorskip("transformers")
pytest.importorskip("torchvision")

from mmgate.chat.template import render_chat  # noqa: E402
from mmgate.chat.tokenizer import load_tokenizer  # noqa: E402
from mmgate.errors import GatewayError  # noqa: E402
from mmgate.media.image import decode_image  # noqa: E402
from mmgate.models.backend import ImageBackend  # noqa: E402
from mmgate.models.bundle import load_bundle  # noqa: E402
from mmgate.models.family import assemble  # noqa: E402
from mmgate.models.llama4 import Llama4Family, canvas_plan, supported_resolutions  # noqa: E402
from mmgate.pipeline.planning import splice_all  # noqa: E402

SEED = live.live_seed("llama4")
BUNDLE = "meta-llama--Llama-4-Scout-17B-16E-Instruct"
NUM_RANDOM = 200
TILE = 336
BACKENDS = (ImageBackend.PIL, ImageBackend.TORCHVISION)

#: the default run's sample (width, height, mode)
SAMPLE = (
    (1, 1, "RGB"), (1, 57, "L"), (57, 1, "RGB"), (336, 336, "P"), (337, 336, "RGB"), (336, 337, "LA"),
    (672, 336, "RGBA"), (673, 336, "RGB"), (640, 480, "RGB"), (27, 29, "P+alpha"), (97, 61, "P+tRNS"),
    (1008, 336, "L"), (335, 1009, "RGB"), (1344, 1344, "RGB"), (400, 1345, "RGB"), (3, 700, "RGB"),
    (700, 3, "RGBA"), (1023, 769, "RGB"), (450, 200, "RGB"), (2000, 90, "RGB"),
)


@cache
def reference() -> live.Reference:
    """The bundle, mmgate's family per backend, the one reference processor (used for both)."""
    path = find_bundle_dir(BUNDLE)
    if path is None:
        pytest.skip(f"model bundle {BUNDLE} not on MMGATE_MODEL_PATH / ../shared/models")
    from transformers import AutoProcessor

    bundle = load_bundle(Path(path))
    tok = load_tokenizer(bundle)
    processor = AutoProcessor.from_pretrained(str(path))
    assert type(processor.image_processor).__name__ == "Llama4ImageProcessor"
    return live.Reference(folder=BUNDLE, path=Path(path), bundle=bundle, tokenizer=tok,
                          families={be: Llama4Family.from_bundle(bundle, tok, be) for be in BACKENDS},
                          ref_image={be: processor.image_processor for be in BACKENDS},
                          ref_processor={be: processor for be in BACKENDS})


def canvases() -> list[tuple[int, int]]:
    """Every canvas ``(rows, cols)`` of at most 16 tiles."""
    return sorted({(h // TILE, w // TILE) for h, w in supported_resolutions(16, TILE)})


# ---------------------------------------------------------------- corpus


def edge_specs(seed: int) -> list[ImageSpec]:
    """Strips, tiny sizes, each canvas at its exact size and with one more pixel on its long side
    (the next canvas), the 16-tile limit and past it, every mode and JPEG."""
    sizes = [(1, 1), (2, 1), (1, 2), (1, 57), (57, 1), (1, 336), (336, 1), (335, 335), (337, 337), (5000, 1),
             (1, 5000), (5377, 336), (336, 5377), (1345, 1345), (2000, 1500)]
    for rows, cols in canvases():
        w, h = cols * TILE, rows * TILE
        sizes += [(w, h), (w + 1, h) if w >= h else (w, h + 1)]
    specs = [ImageSpec(w, h, "RGB", seed + i, name="edge") for i, (w, h) in enumerate(sizes)]
    return specs + live.mode_specs(seed, lambda j: (350 + 3 * j, 301), lambda j: (61, 97 + 7 * j), (1023, 769))


def random_specs(rng: np.random.Generator, count: int) -> list[ImageSpec]:
    """Log-uniform sides 1..1400 (aspect <= 50), one in ten near a canvas edge (+-2 px)."""
    specs: list[ImageSpec] = []
    all_canvases = canvases()
    while len(specs) < count:
        if len(specs) % 10 == 0:
            rows, cols = all_canvases[int(rng.integers(0, len(all_canvases)))]
            if rows * cols > 6:
                continue
            w, h = cols * TILE + int(rng.integers(-2, 3)), rows * TILE + int(rng.integers(-2, 3))
        else:
            w, h = (round(math.exp(v)) for v in rng.uniform(0.0, math.log(1400), size=2))
            if max(w, h) / min(w, h) > 50:
                continue
        specs.append(live.random_spec(rng, w, h))
    return specs


# ---------------------------------------------------------------- comparison


def compare_one(key: str, backend: ImageBackend, job: live.Job, data: bytes) -> tuple[str, float]:
    """``pixel_values`` and ``aspect_ratios`` identical, ``patches_per_image`` the tile count, the
    token run the processor's ``replace_image_token``."""
    case = reference()
    proc = case.families[backend].image
    try:
        decoded = decode_image(data, live.MAX_DECODE_PIXELS)
        plan = proc.plan(decoded.height, decoded.width)
    except GatewayError as exc:
        return f"mmgate refused ({exc.code}: {exc})", math.nan
    batch = assemble(proc, [plan], [proc.preprocess(decoded, plan)])
    out = case.ref_image[backend](images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    ref_pv = out["pixel_values"].float().numpy()
    wanted = {"pixel_values": ref_pv, "aspect_ratios": out["aspect_ratios"].numpy(),
              "patches_per_image": np.array([ref_pv.shape[0]], dtype=np.int64)}
    problems, diff = live.tensor_problems(wanted, batch.tensors, same_dtype=("aspect_ratios", "patches_per_image"))
    processor = case.ref_processor[backend]
    run = processor.tokenizer(processor.replace_image_token(out, 0), add_special_tokens=False)["input_ids"]
    if tuple(run) != proc.expand(plan).token_ids:
        problems.append(f"token run of {len(proc.expand(plan).token_ids)} ids differs from the reference's {len(run)}")
    return ("; ".join(problems) if problems else live.EQUAL), diff


def check_results(key: str, backend: ImageBackend, results: list[live.Result]) -> None:
    """Nothing is refused (the reference refuses no size either)."""
    assert not any(r.outcome == live.REFUSED for r in results)


def full_corpus(key: str) -> list[live.Job]:
    specs = edge_specs(SEED % 100_000) + random_specs(np.random.default_rng([SEED, 4]), NUM_RANDOM)
    assert sum(s.name == "random" for s in specs) >= 200
    return [live.Job(s) for s in specs]


def sample_corpus(key: str) -> list[live.Job]:
    return [live.Job(ImageSpec(w, h, mode, SEED % 100_000 + i, name="sample")) for i, (w, h, mode) in enumerate(SAMPLE)]


LIVE = live.LiveFamily(label="llama4", keys=("llama4",), key_id=str, seed=SEED, compare=compare_one,
                       full=full_corpus, sample=sample_corpus, check_results=check_results)


# ---------------------------------------------------------------- geometry at every boundary


def _reference_geometry(height: int, width: int, resolutions) -> tuple[tuple[int, int], tuple[int, int]]:
    from transformers.models.llama4.image_processing_llama4 import get_best_fit, get_max_res_without_distortion

    canvas = get_best_fit((height, width), resolutions, resize_to_max_canvas=False)
    ch, cw = int(canvas[0]), int(canvas[1])
    rh, rw = get_max_res_without_distortion((height, width), (min(max(height, TILE), ch), min(max(width, TILE), cw)))
    return (ch, cw), (max(rh, 1), max(rw, 1))


def test_canvas_and_resize_size_equal_the_reference_at_every_tiling_boundary() -> None:
    """Each canvas's exact size and every +-1 neighbour, half, double, and a grid of sizes up to 6000."""
    import torch
    from transformers.image_utils import SizeDict
    from transformers.models.llama4.image_processing_llama4 import find_supported_resolutions

    ref_list = find_supported_resolutions(max_num_chunks=16, patch_size=SizeDict(height=TILE, width=TILE))
    assert tuple(tuple(r) for r in ref_list) == supported_resolutions(16, TILE)
    resolutions = torch.tensor(ref_list)
    params = reference().families[ImageBackend.TORCHVISION].image.params
    sizes: set[tuple[int, int]] = set()
    for rows, cols in canvases():
        h, w = rows * TILE, cols * TILE
        sizes |= {(h + dh, w + dw) for dh in (-1, 0, 1) for dw in (-1, 0, 1)}
        sizes |= {(h // 2, w // 2), (h * 2, w * 2), (h * 2 + 1, w * 2 - 1), (h * 3, w * 3 + 1)}
    grid = [1, 2, 3, 7, 50, 167, 168, 169, 335, 336, 337, 500, 671, 672, 673, 1000, 1007, 1008, 1009, 1343, 1344,
            1345, 2000, 2687, 2688, 2689, 4000, 5375, 5376, 5377, 6000]
    sizes |= {(h, w) for h in grid for w in grid}
    bad = [(h, w) for h, w in sorted(sizes) if canvas_plan(h, w, params) != _reference_geometry(h, w, resolutions)]
    assert not bad, f"{len(bad)} of {len(sizes)} sizes differ, first {bad[:5]}"
    assert len(sizes) > 1000


# ---------------------------------------------------------------- conversations

CONVERSATIONS = (
    [("user", [0, "What is in this image?"])],
    [("user", ["Compare ", 0, " with ", 1, "."])],
    [("system", ["You are terse."]), ("user", [0, 1, 2, "Which of the three is brighter? é 日本語 🙂"])],
    [("user", ["Describe ", 0, " please."]), ("assistant", ["A gradient."]), ("user", [1, "And this one?"])],
)


def run_conversations(backend: ImageBackend, count: int, seed: int) -> None:
    case = reference()
    proc = case.families[backend].image
    processor = case.ref_processor[backend]
    rng = np.random.default_rng(seed)
    failures: list[str] = []
    for k in range(count):
        turns = CONVERSATIONS[k % len(CONVERSATIONS)]
        n = 1 + max(p for _, parts in turns for p in parts if isinstance(p, int))
        specs = [ImageSpec(*(int(v) for v in rng.integers(1, 900, size=2)), str(rng.choice(("RGB", "RGB", *MODES))),
                           int(rng.integers(0, 2**31))) for _ in range(n)]
        datas = [s.encode() for s in specs]
        messages = reference_messages(turns, [Image.open(io.BytesIO(d)) for d in datas], flatten_text_turns=False)
        prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ref = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                            return_tensors="pt")
        mine = render_chat(case.bundle.chat_template, template_messages(turns, flatten_text_turns=False),
                           case.tokenizer.special_tokens)
        decoded = [decode_image(d, live.MAX_DECODE_PIXELS) for d in datas]
        plans = [proc.plan(im.height, im.width) for im in decoded]
        reps = [proc.expand(p) for p in plans]
        ids, ranges = splice_all(case.tokenizer.encode_prompt(mine), {proc.anchor_token_id: reps})
        batch = assemble(proc, plans, [proc.preprocess(im, pl) for im, pl in zip(decoded, plans)])
        labels = ", ".join(s.label() for s in specs)
        ref_ids = ref["input_ids"][0].tolist()
        if mine != prompt:
            failures.append(f"conversation {k}: rendered prompt differs")
        if ids != ref_ids:
            failures.append(f"conversation {k} [{labels}]: {live.first_difference(ids, ref_ids)}")
        for r, rep in zip(ranges[proc.anchor_token_id], reps):
            if tuple(ids[r.offset:r.offset + r.length]) != rep.token_ids:
                failures.append(f"conversation {k} [{labels}]: a placeholder range is not its whole run")
        if live.max_abs_diff(ref["pixel_values"].float().numpy(), batch.tensors["pixel_values"]) != 0.0:
            failures.append(f"conversation {k} [{labels}]: batched pixel_values differ")
    assert not failures, f"seed={SEED} llama4 backend={backend.value}:\n" + "\n".join(failures)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_expanded_input_ids_ranges_and_batch_equal_the_reference_chat(backend: ImageBackend) -> None:
    run_conversations(backend, 2, SEED + 7)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_expanded_input_ids_equal_the_reference_chat_on_many_conversations(backend: ImageBackend) -> None:
    run_conversations(backend, 12, SEED + 11)
