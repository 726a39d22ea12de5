"""Tier (a): the LLaVA-1.5 and LLaVA-NeXT families against golden fingerprints of transformers.

``golden/llava.json`` and ``golden/llava_next.json`` were written by
``scripts/gen_golden_llava.py`` (versions recorded in the files).  No transformers here, and no
torch for the ``pil`` rows: the same image bytes are regenerated (``parity_support.ImageSpec``)
and run through the family's image processor directly (``decode_image`` -> ``plan`` ->
``preprocess`` -> ``mmgate.models.family.assemble``); the ``pixel_values`` shape, sha256 and
probe values, ``image_sizes``, the geometry and the token count must match the reference's.

Prompts: the chat template rendered by mmgate (``{"type": "image"}`` parts, as the planner
passes them), tokenized by ``BundleTokenizer.encode_prompt`` (which adds the one BOS the
processor's tokenizer call adds), each ``<image>`` anchor spliced with ``expand(plan)``
(``mmgate.pipeline.planning.splice_all``) must give the reference ids
(``processor(text=apply_chat_template(..., tokenize=False), images=...)``), and every
placeholder range must be exactly its ``<image>`` run (vLLM's ``PromptReplacement`` for both).

Also here, without the reference: wire specs (vLLM ``_get_mm_fields_config``), hint refusals,
the resize bound, limits, the registry dispatch and the ported arithmetic on worked examples.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path

import numpy as np
import PIL
import pytest
from parity_support import GOLDEN_DIR, ImageSpec, find_bundle_dir

from mmgate.chat.template import render_chat
from mmgate.chat.tokenizer import load_tokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.image import decode_image
from mmgate.models.bundle import load_bundle
from mmgate.models.family import assemble
from mmgate.models.llava import (
    MAX_RESIZED_PIXELS,
    LlavaFamily,
    crop_span,
    shortest_edge_size,
)
from mmgate.models.llava_next import (
    LlavaNextFamily,
    patch_output_size,
    select_best_resolution,
    unpadded_features,
)
from mmgate.models.registry import FAMILY_BY_MODEL_TYPE, load_family
from mmgate.pipeline.planning import splice_all
from mmgate.config.settings import FetchSettings
from mmgate.models.backend import ImageBackend
from mmgate.types import ItemHints, Modality, TensorLayout

GOLDENS = {name: json.loads((GOLDEN_DIR / f"{name}.json").read_text(encoding="utf-8"))
           for name in ("llava", "llava_next")}
FAMILY_CLASSES = {"llava": LlavaFamily, "llava_next": LlavaNextFamily}
MAX_DECODE_PIXELS = FetchSettings().max_image_pixels
BACKENDS = ("pil", "torchvision")


def versions_note(golden: dict) -> str:
    local = {"Pillow": PIL.__version__, "numpy": np.__version__}
    try:
        import torch
        import torchvision

        local |= {"torch": torch.__version__, "torchvision": torchvision.__version__}
    except ImportError:
        local |= {"torch": "missing", "torchvision": "missing"}
    versions = golden["versions"]
    parts = [f"{k} golden={versions.get(k)} here={v}" for k, v in local.items()]
    return ("(" + ", ".join(parts) + f"; golden from transformers {versions.get('transformers')}: if a version "
            "differs, regenerate with scripts/gen_golden_llava.py and run test_llava_live_parity.py first)")


def spec_of(golden: dict, name: str) -> ImageSpec:
    img = next(i for i in golden["images"] if i["name"] == name)
    return ImageSpec(img["width"], img["height"], img["mode"], img["seed"], img["format"], name)


@cache
def image_bytes(family: str, name: str) -> bytes:
    return spec_of(GOLDENS[family], name).encode()


@cache
def bundle_and_tokenizer(folder: str):
    path = find_bundle_dir(folder)
    if path is None:
        pytest.skip(f"model bundle {folder} not on MMGATE_MODEL_PATH / ../shared/models")
    bundle = load_bundle(Path(path))
    return bundle, load_tokenizer(bundle)


@cache
def family_for(name: str, backend: str):
    bundle, tok = bundle_and_tokenizer(GOLDENS[name]["bundles"][0]["bundle"])
    return FAMILY_CLASSES[name].from_bundle(bundle, tok, ImageBackend(backend))


def sha256_f32le(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<f4").tobytes()).hexdigest()


def probe(array: np.ndarray) -> list[float]:
    flat = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
    return [float(flat[k * (flat.size - 1) // 7]) for k in range(8)]


def template_messages(turns: list) -> list[dict]:
    """The conversation as the planner hands it to the template: ``{"type": "image"}`` parts."""
    return [{"role": role, "content": [{"type": "image"} if isinstance(p, int) else {"type": "text", "text": p}
                                       for p in parts]} for role, parts in turns]


ROWS = [pytest.param(name, row, id=f"{name}-{row['backend']}-{row['image']}")
        for name, golden in GOLDENS.items() for row in golden["rows"]]
CONVERSATIONS = [pytest.param(name, conv, backend, id=f"{name}-{len(conv['images'])}img-{backend}")
                 for name, golden in GOLDENS.items() for conv in golden["conversations"] for backend in BACKENDS]


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_golden_file_is_small_and_covers_both_backends_and_every_image(name: str) -> None:
    golden = GOLDENS[name]
    assert (GOLDEN_DIR / f"{name}.json").stat().st_size < 100_000
    keys = {(r["backend"], r["image"]) for r in golden["rows"]}
    assert keys == {(be, img["name"]) for be in BACKENDS for img in golden["images"]}
    assert golden["bundles"][0]["model_type"] == name
    assert {len(c["images"]) for c in golden["conversations"]} == {1, 2, 3}


@pytest.mark.parametrize("name", sorted({img["name"] for g in GOLDENS.values() for img in g["images"]}))
def test_decoded_rgb_pixels_equal_the_reference_decode(name: str) -> None:
    for family, golden in GOLDENS.items():
        entry = next((i for i in golden["images"] if i["name"] == name), None)
        if entry is None:
            continue
        decoded = decode_image(image_bytes(family, name), MAX_DECODE_PIXELS)
        digest = hashlib.sha256(np.ascontiguousarray(decoded.pixels).tobytes()).hexdigest()
        assert digest == entry["rgb_sha256"], f"{name}: decoded RGB differs {versions_note(golden)}"


@pytest.mark.parametrize(("name", "row"), ROWS)
def test_pixel_values_geometry_and_token_count_equal_the_reference(name: str, row: dict) -> None:
    golden = GOLDENS[name]
    proc = family_for(name, row["backend"]).image
    label = f"{name} backend={row['backend']} image={spec_of(golden, row['image']).label()}"
    decoded = decode_image(image_bytes(name, row["image"]), MAX_DECODE_PIXELS)
    plan = proc.plan(decoded.height, decoded.width)
    assert list(plan.resized_hw) == row["resized_hw"], label
    if "best_resolution" in row:
        assert list(plan.detail[:2]) == row["best_resolution"], label
    assert plan.num_tokens == row["num_image_tokens"], label
    share = proc.preprocess(decoded, plan)
    assert share.dtype == np.float32 and share.shape == plan.primary_shape, label
    batch = assemble(proc, [plan], [share])
    pv = batch.tensors["pixel_values"]
    assert list(pv.shape) == [1, *row["pixel_values_shape"]], label
    assert probe(pv[0]) == row["pixel_values_probe"], f"{label}: probe values differ {versions_note(golden)}"
    assert sha256_f32le(pv[0]) == row["pixel_values_sha256"], f"{label}: pixel_values differ {versions_note(golden)}"
    if "image_sizes" in row:
        assert batch.tensors["image_sizes"].dtype == np.int64
        assert batch.tensors["image_sizes"].tolist() == [row["image_sizes"]], label


@pytest.mark.parametrize(("name", "conv", "backend"), CONVERSATIONS)
def test_expanded_input_ids_and_placeholder_ranges_equal_the_reference(name: str, conv: dict, backend: str) -> None:
    bundle, tok = bundle_and_tokenizer(conv["bundle"])
    proc = family_for(name, backend).image
    prompt = render_chat(bundle.chat_template, template_messages(conv["turns"]), tok.special_tokens)
    assert prompt == conv["prompt"]
    anchored = tok.encode_prompt(prompt)
    assert anchored == conv["input_ids_collapsed"]  # one <image> per image before expansion, one BOS
    decoded = [decode_image(image_bytes(name, n), MAX_DECODE_PIXELS) for n in conv["images"]]
    plans = [proc.plan(im.height, im.width) for im in decoded]
    ids, ranges = splice_all(anchored, {proc.anchor_token_id: [proc.expand(pl) for pl in plans]})
    assert [pl.num_tokens for pl in plans] == conv["runs"]
    assert len(ids) == conv["input_ids_len"] and ids.count(proc.placeholder_token_id) == conv["num_image_tokens"]
    assert hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest() == conv["input_ids_sha256"]
    # each range is exactly one whole run of <image> (vLLM PromptReplacement: target [id], replacement [id] * n)
    runs = [(i, n) for i, n in _runs(ids, proc.placeholder_token_id)]
    assert [(r.offset, r.length) for r in ranges[proc.anchor_token_id]] == runs
    batch = assemble(proc, plans, [proc.preprocess(im, pl) for im, pl in zip(decoded, plans)])
    assert list(batch.tensors["pixel_values"].shape) == conv["pixel_values_shape"]
    if "image_sizes" in conv:
        assert batch.tensors["image_sizes"].tolist() == conv["image_sizes"]
    if backend == "torchvision":  # the recorded batch is the torchvision processor's
        assert sha256_f32le(batch.tensors["pixel_values"]) == conv["pixel_values_sha256"]


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


# ---------------------------------------------------------------- without the reference


def test_specs_follow_vllm_llava_and_llava_next_mm_fields_config() -> None:
    """vLLM v0.11.0 / v0.19.0: llava ``pixel_values`` batched; llava_next ``pixel_values`` and
    ``image_sizes`` batched; no ``keep_on_cpu``; ``im_token_id`` = ``<image>`` (32000)."""
    llava, nxt = family_for("llava", "pil").image, family_for("llava_next", "pil").image
    assert [(s.name, s.dtype, s.layout, s.keep_on_cpu, s.primary) for s in llava.specs] == [
        ("pixel_values", "float32", TensorLayout.BATCHED, False, True)]
    assert [(s.name, s.dtype, s.layout, s.keep_on_cpu, s.primary) for s in nxt.specs] == [
        ("pixel_values", "float32", TensorLayout.BATCHED, False, True),
        ("image_sizes", "int64", TensorLayout.BATCHED, False, False)]
    for proc in (llava, nxt):
        assert proc.anchor_token_id == proc.placeholder_token_id == 32000


def test_items_with_different_tile_counts_are_zero_padded_as_pad_for_batching() -> None:
    proc = family_for("llava_next", "pil").image
    small = decode_image(ImageSpec(672, 336, "RGB", 1).encode(), MAX_DECODE_PIXELS)  # 336x672 pinpoint: 3 tiles
    big = decode_image(ImageSpec(640, 480, "RGB", 2).encode(), MAX_DECODE_PIXELS)  # 672x672: 5 tiles
    plans = [proc.plan(im.height, im.width) for im in (small, big)]
    assert [pl.primary_shape[0] for pl in plans] == [3, 5]
    shares = [proc.preprocess(im, pl) for im, pl in zip((small, big), plans)]
    batch = assemble(proc, plans, shares)
    pv = batch.tensors["pixel_values"]
    assert pv.shape == (2, 5, 3, 336, 336)
    assert np.array_equal(pv[0, :3], shares[0]) and not pv[0, 3:].any()
    assert batch.tensors["image_sizes"].tolist() == [[336, 672], [480, 640]]


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_raw_share_is_the_cropped_bytes_in_the_same_layout(name: str) -> None:
    proc = family_for(name, "pil").image
    decoded = decode_image(ImageSpec(97, 61, "RGB", 3).encode(), MAX_DECODE_PIXELS)
    plan = proc.plan(decoded.height, decoded.width)
    raw, values = proc.preprocess(decoded, plan, raw=True), proc.preprocess(decoded, plan)
    assert raw.dtype == np.uint8 and raw.shape == values.shape == plan.primary_shape
    mean = np.float32(0.48145466) * np.float32(255)
    assert np.array_equal(values[..., 0, :, :] < 0, raw[..., 0, :, :] < mean)  # normalization is monotone


def test_thin_strip_beyond_the_resize_bound_is_refused_and_the_bound_is_about_594_to_1() -> None:
    proc = family_for("llava", "pil").image
    assert proc.plan(1, 594).resized_hw == (336, 199584)  # 336 * 199584 = 67,060,224 <= 2**26
    with pytest.raises(GatewayError) as info:
        proc.plan(1, 595)  # 336 * 199920 > 2**26
    assert info.value.code is ErrorCode.IMAGE_ASPECT_RATIO_INVALID
    assert 336 * 199584 <= MAX_RESIZED_PIXELS < 336 * 199920
    # LLaVA-NeXT has no such blow-up: the anyres resize stays inside a pinpoint
    plan = family_for("llava_next", "pil").image.plan(1, 100_000)
    assert plan.detail[:2] == (336, 672) and plan.resized_hw == (1, 672)


@pytest.mark.parametrize("name", sorted(GOLDENS))
@pytest.mark.parametrize(("hints", "param"), [
    (ItemHints(max_long_side_pixel=336), "messages[0].content[0].max_long_side_pixel"),
    (ItemHints(options=(("do_pad", False),)), "mm_processor_kwargs"),
])
def test_hints_the_processor_has_no_knob_for_are_refused(name: str, hints: ItemHints, param: str) -> None:
    with pytest.raises(GatewayError) as info:
        family_for(name, "pil").image.check_hints(hints, "messages[0].content[0]")
    assert info.value.code is ErrorCode.INVALID_REQUEST and info.value.param == param


def test_registry_serves_both_with_images_only_and_limits_from_the_context() -> None:
    assert FAMILY_BY_MODEL_TYPE["llava"] is LlavaFamily and FAMILY_BY_MODEL_TYPE["llava_next"] is LlavaNextFamily
    for name, limit in (("llava", 4096 // 576), ("llava_next", 16)):
        bundle, tok = bundle_and_tokenizer(GOLDENS[name]["bundles"][0]["bundle"])
        family = load_family(bundle, tok, ImageBackend.PIL)
        assert isinstance(family, FAMILY_CLASSES[name])
        assert family.video is None and dict(family.limits) == {Modality.IMAGE: limit}
        assert family.reserved_tokens == ("<image>",)


@pytest.mark.parametrize(("hw", "best", "resized", "tokens"), [
    ((480, 640), (672, 672), (504, 672), 2340),  # 36*48 + 36 newlines + 576 base
    ((1, 1), (336, 672), (336, 336), 1176),  # every pinpoint keeps 1 pixel: least waste, first of the tie
    ((336, 672), (336, 672), (336, 672), 1752),  # exactly a pinpoint: 24*48 + 24 + 576
    ((1000, 2), (1008, 336), (1008, 3), 648),  # unpadded width 0: 0 + 72 newlines + 576
])
def test_anyres_arithmetic_on_worked_examples(hw, best, resized, tokens) -> None:
    h, w = hw
    proc = family_for("llava_next", "pil").image
    assert select_best_resolution(h, w, proc.pinpoints) == best
    assert patch_output_size(h, w, best) == resized
    assert proc.num_tokens(h, w) == tokens


def test_unpadded_features_rounds_as_the_processor() -> None:
    # 480x640 on 2x2 tiles of 24x24: new_height = int(round(480 * (48 / 640), 7)) = 36, padding (48 - 36) // 2 = 6
    assert unpadded_features(480, 640, 24, 24, 2, 2) == (36 * 48, 36)
    # 2x1000 (w x h) on 3x1 tiles: new_width = int(round(2 * (72 / 1000), 7)) = 0, padding 12: width 0 -> 0 features
    assert unpadded_features(1000, 2, 24, 24, 3, 1) == (72 * 0, 72)


def test_clip_resize_and_crop_arithmetic() -> None:
    assert shortest_edge_size(480, 640, 336) == (336, 448)
    assert shortest_edge_size(1000, 1, 336) == (336000, 336)
    assert shortest_edge_size(337, 335, 336) == (int(336 * 337 / 335), 336) == (338, 336)
    assert crop_span(448, 336, ImageBackend.PIL) == crop_span(448, 336, ImageBackend.TORCHVISION) == (56, 0, 336)
    # a crop larger than the image pads: PIL places it at ceil(d / 2), torchvision at floor(d / 2)
    assert crop_span(335, 336, ImageBackend.PIL) == (0, 1, 335)
    assert crop_span(335, 336, ImageBackend.TORCHVISION) == (0, 0, 335)


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_pil_backend_runs_without_transformers_or_torch(name: str) -> None:
    golden = GOLDENS[name]
    row = next(r for r in golden["rows"] if r["backend"] == "pil" and r["image"] == "rgb_640x480")
    folder = golden["bundles"][0]["bundle"]
    if find_bundle_dir(folder) is None:
        pytest.skip(f"model bundle {folder} not on the model search path")
    img = next(i for i in golden["images"] if i["name"] == row["image"])
    script = textwrap.dedent(f"""
        import hashlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("transformers", "torch", "torchvision"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import numpy as np
        from pathlib import Path
        from parity_support import ImageSpec, find_bundle_dir
        from mmgate.chat.tokenizer import load_tokenizer
        from mmgate.media.image import decode_image
        from mmgate.models.bundle import load_bundle
        from mmgate.models.registry import load_family
        from mmgate.models.backend import ImageBackend
        bundle = load_bundle(Path(find_bundle_dir({folder!r})))
        proc = load_family(bundle, load_tokenizer(bundle), ImageBackend.PIL).image
        decoded = decode_image(ImageSpec({img['width']}, {img['height']}, {img['mode']!r}, {img['seed']},
                                         {img['format']!r}).encode(), 10**9)
        plan = proc.plan(decoded.height, decoded.width)
        share = proc.preprocess(decoded, plan)
        assert not any(m.split(".")[0] in ("transformers", "torch") for m in sys.modules)
        print(hashlib.sha256(np.ascontiguousarray(share, dtype="<f4").tobytes()).hexdigest())
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == row["pixel_values_sha256"]
