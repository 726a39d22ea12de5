"""The golden tier's harness: every fixture in ``golden/`` replayed through mmgate, without transformers.

In: a fixture written by ``scripts/gen_golden.py`` (one per family: ``qwen_vl``, ``llava``,
``llava_next``, ``gemma3``, ``llama4``); the image bytes are regenerated from its ``images`` entries
(``parity_support.ImageSpec``), decoded by ``decode_image`` and run through the family the
registry builds for the row's bundle and backend (``plan`` -> ``preprocess`` -> ``assemble``).
Out: assertions, one fixture row or conversation at a time, by the fixture's :class:`GoldenFamily`.

What differs per family is data here, not a copy of the test: :data:`FAMILIES` holds, per fixture,
the size bound, the model types, the option sets every image is recorded with, which pil row the
torch-free check replays, and the two replay functions (a pixel row; a conversation on one
backend).  The replays share the loading, decoding and messages of this module; each checks the
fields its fixture records.  ``test_golden_replay.py`` parametrizes over all of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import PIL
import pytest
from gemma3_support import PAS_ON, options_tuple, replacement_ranges, substitute_anchors
from internvl_support import internvl_conversation, internvl_row
from parity_support import (
    GOLDEN_DIR,
    ImageSpec,
    collapse_runs,
    find_bundle_dir,
    openai_messages,
    probe8,
    sha256_f32le,
    sha256_ids,
    splice_anchors,
    template_messages,
    whole_runs,
)

from mmgate.chat.template import render_chat
from mmgate.chat.tokenizer import load_tokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.image import DecodedImage, decode_image
from mmgate.models.bundle import load_bundle
from mmgate.models.family import assemble
from mmgate.models.registry import load_family
from mmgate.pipeline.planning import splice_all
from mmgate.config.settings import FetchSettings
from mmgate.models.backend import ImageBackend
from mmgate.types import ItemHints

MAX_DECODE_PIXELS = FetchSettings().max_image_pixels
BACKENDS = ("pil", "torchvision")


@cache
def golden(name: str) -> dict:
    """The fixture ``golden/<name>.json``."""
    return json.loads((GOLDEN_DIR / f"{name}.json").read_text(encoding="utf-8"))


def versions_note(name: str) -> str:
    """Recorded vs local versions: a different Pillow may legitimately change PIL decodes and resizes,
    a different torch the torchvision backend's resize."""
    local = {"Pillow": PIL.__version__, "numpy": np.__version__}
    try:
        import torch
        import torchvision

        local |= {"torch": torch.__version__, "torchvision": torchvision.__version__}
    except ImportError:
        local |= {"torch": "missing", "torchvision": "missing"}
    versions = golden(name)["versions"]
    parts = [f"{k} golden={versions.get(k)} here={v}" for k, v in local.items()]
    return ("(" + ", ".join(parts) + f"; golden from transformers {versions.get('transformers')}: if a version "
            f"differs, regenerate with scripts/gen_golden.py --family {name} and run the live tier "
            "(test_*_live_parity.py) before calling this an mmgate bug)")


def spec_of(name: str, image: str) -> ImageSpec:
    img = next(i for i in golden(name)["images"] if i["name"] == image)
    return ImageSpec(img["width"], img["height"], img["mode"], img["seed"], img["format"], image)


@cache
def image_bytes(name: str, image: str) -> bytes:
    return spec_of(name, image).encode()


def decoded(name: str, image: str) -> DecodedImage:
    return decode_image(image_bytes(name, image), MAX_DECODE_PIXELS)


@cache
def bundle_and_tokenizer(folder: str):
    path = find_bundle_dir(folder)
    if path is None:
        pytest.skip(f"model bundle {folder} not on MMGATE_MODEL_PATH / ../shared/models")
    bundle = load_bundle(Path(path))
    return bundle, load_tokenizer(bundle)


@cache
def family_for(folder: str, backend: str):
    bundle, tok = bundle_and_tokenizer(folder)
    return load_family(bundle, tok, ImageBackend(backend))


def row_label(name: str, row: dict) -> str:
    opts = f" options={row['options']}" if "options" in row else ""
    return f"{row['bundle']} backend={row['backend']} image={spec_of(name, row['image']).label()}{opts}"


# ---------------------------------------------------------------- Qwen-VL


def qwen_vl_row(name: str, row: dict) -> None:
    """``resized_hw``, ``image_grid_thw``, token count, ``pixel_values`` shape and sha256; or the refusal."""
    family = family_for(row["bundle"], row["backend"])
    label = row_label(name, row)
    image = decoded(name, row["image"])
    if "refused" in row:
        with pytest.raises(GatewayError) as info:
            family.image.plan(image.height, image.width)
        assert info.value.code is ErrorCode.IMAGE_ASPECT_RATIO_INVALID, label
        return
    plan = family.image.plan(image.height, image.width)
    assert list(plan.resized_hw) == row["resized_hw"], label
    assert list(plan.detail) == row["image_grid_thw"], label
    assert plan.num_tokens == row["num_image_tokens"], label
    batch = assemble(family.image, [plan], [family.image.preprocess(image, plan)])
    pv = batch.tensors["pixel_values"]
    assert pv.dtype == np.float32, label
    assert list(pv.shape) == row["pixel_values_shape"], label
    assert batch.tensors["image_grid_thw"].tolist() == [row["image_grid_thw"]], label
    assert sha256_f32le(pv) == row["pixel_values_sha256"], f"{label}: pixel_values differ {versions_note(name)}"


def qwen_vl_conversation(name: str, conv: dict, backend: str) -> None:
    """OpenAI messages rendered and tokenized by mmgate, each pad spliced with ``expand(plan).token_ids``."""
    bundle, tok = bundle_and_tokenizer(conv["bundle"])
    proc = family_for(conv["bundle"], backend).image
    urls = [f"data:image/png;base64,<{i}>" for i in range(len(conv["images"]))]  # the template only tests the key
    prompt = render_chat(bundle.chat_template, openai_messages(conv["turns"], urls), tok.special_tokens)
    anchored = tok.encode_prompt(prompt)
    plans = [proc.plan(im.height, im.width) for im in (decoded(name, n) for n in conv["images"])]
    ids = splice_anchors(anchored, proc.image_token_id, [proc.expand(pl).token_ids for pl in plans])
    assert anchored == conv["input_ids_collapsed"]  # one pad per image before expansion
    assert [pl.num_tokens for pl in plans] == conv["pad_runs"]
    assert len(ids) == conv["input_ids_len"]
    assert ids.count(proc.image_token_id) == conv["num_image_pad"]
    assert sha256_ids(ids) == conv["input_ids_sha256"]


# ---------------------------------------------------------------- LLaVA-1.5 / LLaVA-NeXT


def llava_row(name: str, row: dict) -> None:
    """Geometry (NeXT: the pinpoint), token count, the share's shape, probe and sha256, ``image_sizes``."""
    proc = family_for(row["bundle"], row["backend"]).image
    label = row_label(name, row)
    image = decoded(name, row["image"])
    plan = proc.plan(image.height, image.width)
    assert list(plan.resized_hw) == row["resized_hw"], label
    if "best_resolution" in row:
        assert list(plan.detail[:2]) == row["best_resolution"], label
    assert plan.num_tokens == row["num_image_tokens"], label
    share = proc.preprocess(image, plan)
    assert share.dtype == np.float32 and share.shape == plan.primary_shape, label
    batch = assemble(proc, [plan], [share])
    pv = batch.tensors["pixel_values"]
    assert list(pv.shape) == [1, *row["pixel_values_shape"]], label
    assert probe8(pv[0]) == row["pixel_values_probe"], f"{label}: probe values differ {versions_note(name)}"
    assert sha256_f32le(pv[0]) == row["pixel_values_sha256"], f"{label}: pixel_values differ {versions_note(name)}"
    if "image_sizes" in row:
        assert batch.tensors["image_sizes"].dtype == np.int64
        assert batch.tensors["image_sizes"].tolist() == [row["image_sizes"]], label


def llava_conversation(name: str, conv: dict, backend: str) -> None:
    """Rendered prompt, ids, each range one whole ``<image>`` run (vLLM ``PromptReplacement``), the batch."""
    bundle, tok = bundle_and_tokenizer(conv["bundle"])
    proc = family_for(conv["bundle"], backend).image
    prompt = render_chat(bundle.chat_template, template_messages(conv["turns"], flatten_text_turns=False),
                         tok.special_tokens)
    assert prompt == conv["prompt"]
    anchored = tok.encode_prompt(prompt)
    assert anchored == conv["input_ids_collapsed"]  # one <image> per image before expansion, one BOS
    images = [decoded(name, n) for n in conv["images"]]
    plans = [proc.plan(im.height, im.width) for im in images]
    ids, ranges = splice_all(anchored, {proc.anchor_token_id: [proc.expand(pl) for pl in plans]})
    assert [pl.num_tokens for pl in plans] == conv["runs"]
    assert len(ids) == conv["input_ids_len"] and ids.count(proc.placeholder_token_id) == conv["num_image_tokens"]
    assert sha256_ids(ids) == conv["input_ids_sha256"]
    assert [(r.offset, r.length) for r in ranges[proc.anchor_token_id]] == whole_runs(ids, proc.placeholder_token_id)
    batch = assemble(proc, plans, [proc.preprocess(im, pl) for im, pl in zip(images, plans)])
    assert list(batch.tensors["pixel_values"].shape) == conv["pixel_values_shape"]
    if "image_sizes" in conv:
        assert batch.tensors["image_sizes"].tolist() == conv["image_sizes"]
    if backend == "torchvision":  # the recorded batch is the torchvision processor's
        assert sha256_f32le(batch.tensors["pixel_values"]) == conv["pixel_values_sha256"]


# ---------------------------------------------------------------- Gemma 3


def gemma3_row(name: str, row: dict) -> None:
    """With the row's ``mm_processor_kwargs`` as hints: ``num_crops``, token count, the batch, sha256."""
    proc = family_for(row["bundle"], row["backend"]).image
    label = row_label(name, row)
    hints = ItemHints(options=options_tuple(row["options"]))
    proc.check_hints(hints, "messages[0].content[0]")
    image = decoded(name, row["image"])
    plan = proc.plan(image.height, image.width, hints)
    assert plan.detail[0] == row["num_crops"], label
    seq = golden(name)["bundles"][0]["image_seq_length"]
    assert plan.num_tokens == (1 + row["num_crops"]) * seq, label
    batch = assemble(proc, [plan], [proc.preprocess(image, plan)])
    pv = batch.tensors["pixel_values"]
    assert pv.dtype == np.float32 and list(pv.shape) == row["pixel_values_shape"], label
    assert set(batch.tensors) == {"pixel_values", "num_patches"}, label  # vLLM's keys: no num_crops
    assert batch.tensors["num_patches"].tolist() == [row["num_crops"] + 1], label
    if sha256_f32le(pv) != row["pixel_values_sha256"]:
        n, _, h, w = pv.shape
        got = [*pv[0, :, h // 2, w // 2], *pv[n - 1, :, h // 3, w - 1 - w // 3]]
        worst = max(abs(float(a) - b) for a, b in zip(got, row["probe"]))
        pytest.fail(f"{label}: pixel_values differ (probe max |diff| {worst:.3g}) {versions_note(name)}")


def gemma3_conversation(name: str, conv: dict, backend: str) -> None:
    """Each ``<start_of_image>`` replaced by ``expand(plan).text``, then tokenized: the ids, and the
    ``Replacement`` ranges equal to the ones vLLM finds (recorded)."""
    bundle, tok = bundle_and_tokenizer(conv["bundle"])
    proc = family_for(conv["bundle"], backend).image
    prompt = render_chat(bundle.chat_template, template_messages(conv["turns"]), tok.special_tokens)
    assert prompt == conv["prompt"]
    hints = ItemHints(options=options_tuple(conv["options"]))
    plans = [proc.plan(im.height, im.width, hints) for im in (decoded(name, n) for n in conv["images"])]
    assert [pl.detail[0] for pl in plans] == conv["num_crops"]
    reps = [proc.expand(pl) for pl in plans]
    ids = tok.encode_prompt(substitute_anchors(prompt, [r.text for r in reps]))
    assert collapse_runs(ids, proc.placeholder_token_id) == (conv["input_ids_collapsed"], conv["soft_runs"])
    assert len(ids) == conv["input_ids_len"]
    assert ids.count(proc.placeholder_token_id) == conv["num_image_soft"] == sum(pl.num_tokens for pl in plans)
    assert sha256_ids(ids) == conv["input_ids_sha256"]
    ranges = replacement_ranges(ids, proc.placeholder_token_id, [(r.embed_offset, r.embed_length, r.trail) for r in reps])
    if conv["vllm_placeholders"] is not None:
        assert [list(r) for r in ranges] == conv["vllm_placeholders"]
    else:  # a newline run vLLM cannot split: the range opens on the token holding the "\n\n"
        for (start, _), rep in zip(ranges, reps):
            assert rep.embed_offset == 2 and set(tok.decode([ids[start]], skip_special_tokens=False)) == {"\n"}


# ---------------------------------------------------------------- Llama 4


def llama4_row(name: str, row: dict) -> None:
    """Canvas, resize size, ``aspect_ratios``, ``<|patch|>`` count, the batch's keys, probe and sha256."""
    proc = family_for(row["bundle"], row["backend"]).image
    label = row_label(name, row)
    image = decoded(name, row["image"])
    plan = proc.plan(image.height, image.width)
    tile = golden(name)["bundles"][0]["size"]["height"]
    assert [d * tile for d in plan.detail] == row["canvas"] and list(plan.detail) == row["aspect_ratios"], label
    assert list(plan.resized_hw) == row["resized_hw"], label
    assert plan.num_tokens == row["num_image_tokens"], label
    batch = assemble(proc, [plan], [proc.preprocess(image, plan)])
    pv = batch.tensors["pixel_values"]
    assert set(batch.tensors) == {"pixel_values", "patches_per_image", "aspect_ratios"}, label  # vLLM's keys
    assert pv.dtype == np.float32 and list(pv.shape) == row["pixel_values_shape"], label
    assert batch.tensors["patches_per_image"].tolist() == [row["pixel_values_shape"][0]], label
    assert batch.tensors["aspect_ratios"].tolist() == [row["aspect_ratios"]], label
    assert probe8(pv) == row["pixel_values_probe"], f"{label}: probe values differ {versions_note(name)}"
    assert sha256_f32le(pv) == row["pixel_values_sha256"], f"{label}: pixel_values differ {versions_note(name)}"


def llama4_conversation(name: str, conv: dict, backend: str) -> None:
    """Rendered prompt, ids (each ``<|image|>`` spliced with the whole run), each range the whole run
    holding its ``<|patch|>`` tokens, the batch."""
    bundle, tok = bundle_and_tokenizer(conv["bundle"])
    proc = family_for(conv["bundle"], backend).image
    prompt = render_chat(bundle.chat_template, template_messages(conv["turns"], flatten_text_turns=False),
                         tok.special_tokens)
    assert prompt == conv["prompt"]
    anchored = tok.encode_prompt(prompt)
    images = [decoded(name, n) for n in conv["images"]]
    plans = [proc.plan(im.height, im.width) for im in images]
    reps = [proc.expand(pl) for pl in plans]
    ids, ranges = splice_all(anchored, {proc.anchor_token_id: reps})
    patch = proc.placeholder_token_id
    assert collapse_runs(ids, patch) == (conv["input_ids_collapsed"], conv["patch_runs"])
    assert len(ids) == conv["input_ids_len"] and ids.count(patch) == conv["num_image_tokens"]
    assert sha256_ids(ids) == conv["input_ids_sha256"]
    for r, pl, rep in zip(ranges[proc.anchor_token_id], plans, reps):
        window = ids[r.offset:r.offset + r.length]
        assert tuple(window) == rep.token_ids and window.count(patch) == pl.num_tokens
    batch = assemble(proc, plans, [proc.preprocess(im, pl) for im, pl in zip(images, plans)])
    assert list(batch.tensors["pixel_values"].shape) == conv["pixel_values_shape"]
    assert batch.tensors["aspect_ratios"].tolist() == conv["aspect_ratios"]
    assert sha256_f32le(batch.tensors["pixel_values"]) == conv["pixel_values_sha256"]


# ---------------------------------------------------------------- the table


@dataclass(frozen=True, slots=True)
class GoldenFamily:
    """How one fixture is replayed."""

    name: str  # golden/<name>.json
    max_bytes: int  # the fixture stays small and diffable
    model_types: frozenset[str]  # of its bundles
    option_sets: tuple[dict, ...]  # every (bundle, backend, image) has a row with each
    replay_row: Callable[[str, dict], None]
    replay_conversation: Callable[[str, dict, str], None]
    conversation_backends: tuple[str, ...]  # the backends each conversation is replayed on
    torch_free_row: Callable[[dict], bool]  # picks the pil row replayed with torch unimportable
    row_id: Callable[[dict], str]
    #: the backends the reference has (rows and the torch-free check); Llama 4: torchvision only
    backends: tuple[str, ...] = BACKENDS


def _options_id(row: dict) -> str:
    opts = "off" if not row["options"] else "on" if len(row["options"]) == 1 else "custom"
    return f"{row['backend']}-{row['image']}-pas_{opts}"


def _bundle_backend_image(row: dict) -> str:
    return f"{row['bundle'].split('--')[1]}-{row['backend']}-{row['image']}"


def _backend_image(row: dict) -> str:
    return f"{row['backend']}-{row['image']}"


FAMILIES: tuple[GoldenFamily, ...] = (
    GoldenFamily(name="qwen_vl", max_bytes=200_000, model_types=frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}),
                 option_sets=({},), replay_row=qwen_vl_row, replay_conversation=qwen_vl_conversation,
                 conversation_backends=BACKENDS, torch_free_row=lambda r: "refused" not in r,
                 row_id=_bundle_backend_image),
    GoldenFamily(name="llava", max_bytes=100_000, model_types=frozenset({"llava"}),
                 option_sets=({},), replay_row=llava_row, replay_conversation=llava_conversation,
                 conversation_backends=BACKENDS, torch_free_row=lambda r: r["image"] == "rgb_640x480",
                 row_id=_backend_image),
    GoldenFamily(name="llava_next", max_bytes=100_000, model_types=frozenset({"llava_next"}),
                 option_sets=({},), replay_row=llava_row, replay_conversation=llava_conversation,
                 conversation_backends=BACKENDS, torch_free_row=lambda r: r["image"] == "rgb_640x480",
                 row_id=_backend_image),
    GoldenFamily(name="gemma3", max_bytes=200_000, model_types=frozenset({"gemma3"}),
                 option_sets=({}, PAS_ON), replay_row=gemma3_row, replay_conversation=gemma3_conversation,
                 conversation_backends=("pil",), torch_free_row=lambda r: r["num_crops"] > 0,
                 row_id=_options_id),
    GoldenFamily(name="llava_onevision", max_bytes=100_000, model_types=frozenset({"llava_onevision"}),
                 option_sets=({},), replay_row=llava_row, replay_conversation=llava_conversation,
                 conversation_backends=BACKENDS, torch_free_row=lambda r: r["image"] == "rgb_640x480",
                 row_id=_backend_image),
    GoldenFamily(name="llama4", max_bytes=100_000, model_types=frozenset({"llama4"}),
                 option_sets=({},), replay_row=llama4_row, replay_conversation=llama4_conversation,
                 conversation_backends=("torchvision",), torch_free_row=lambda r: r["image"] == "rgb_640x480",
                 row_id=_backend_image, backends=("torchvision",)),
    GoldenFamily(name="internvl", max_bytes=100_000, model_types=frozenset({"internvl"}),
                 option_sets=({},), replay_row=internvl_row, replay_conversation=internvl_conversation,
                 conversation_backends=BACKENDS, torch_free_row=lambda r: r["num_patches"] > 1,
                 row_id=_backend_image),
    GoldenFamily(name="qwen_omni", max_bytes=200_000, model_types=frozenset({"qwen2_5_omni", "qwen3_omni_moe"}),
                 option_sets=({},), replay_row=qwen_vl_row, replay_conversation=qwen_vl_conversation,
                 conversation_backends=BACKENDS, torch_free_row=lambda r: "refused" not in r,
                 row_id=_bundle_backend_image),
)
