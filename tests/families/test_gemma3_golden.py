"""The Gemma 3 family's own checks: pan-and-scan, the text-level prompt update, hints, wire layout.

The golden replay of ``golden/gemma3.json`` (pixel rows per pan-and-scan option set, decodes,
conversations with vLLM's placeholder ranges, the torch-free pil row) is
``test_golden_replay.py``'s (``replay.gemma3_row`` / ``replay.gemma3_conversation``).  Here,
against the fixture's recorded bundle facts or without the reference: what the fixture records
beyond the shared coverage, the exact replacement strings, ``check_hints`` refusals, the
pan-and-scan arithmetic on worked examples, the wire specs and the registry dispatch.
"""

from __future__ import annotations

import hashlib
from functools import cache

import numpy as np
import pytest
from gemma3_support import GEMMA3_BUNDLE, options_tuple, replacement_ranges, vllm_placeholders
from replay import bundle_and_tokenizer as _bundle_and_tokenizer
from replay import decoded, golden

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.family import assemble
from mmgate.models.gemma3 import Gemma3Family, PanAndScan, pan_and_scan_grid
from mmgate.models.registry import FAMILY_BY_MODEL_TYPE, load_family
from mmgate.models.backend import ImageBackend
from mmgate.types import ItemHints, Modality, TensorLayout

GOLDEN = golden("gemma3")
BUNDLE_INFO = GOLDEN["bundles"][0]
DEFAULTS = PanAndScan(enabled=True, min_crop_size=256, max_num_crops=4, min_ratio_to_activate=1.2)


def bundle_and_tokenizer():
    return _bundle_and_tokenizer(GEMMA3_BUNDLE)


@cache
def family_for(backend: str) -> Gemma3Family:
    bundle, tok = bundle_and_tokenizer()
    family = load_family(bundle, tok, ImageBackend(backend))
    assert isinstance(family, Gemma3Family)
    return family


def test_golden_file_records_both_processor_classes_crops_and_pan_and_scan_conversations() -> None:
    """Beyond ``test_golden_replay``'s coverage (a row per backend x image x pan-and-scan off / on)."""
    assert BUNDLE_INFO["image_processor_classes"] == {"torchvision": "Gemma3ImageProcessor",
                                                      "pil": "Gemma3ImageProcessorPil"}
    assert any(r["num_crops"] > 0 for r in GOLDEN["rows"]) and any(c["options"] for c in GOLDEN["conversations"])


# ---------------------------------------------------------------- prompt update


def test_replacement_text_is_the_processors_full_image_sequence() -> None:
    proc = family_for("pil").image
    plan = proc.plan(480, 640)
    rep = proc.expand(plan)
    full = "\n\n<start_of_image>" + "<image_soft_token>" * 256 + "<end_of_image>\n\n"
    assert rep.text == full and rep.token_ids == ()
    assert (rep.embed_offset, rep.embed_length, rep.trail) == (2, 256, 2)  # "\n\n", boi | 256 soft | eoi, "\n\n"
    assert hashlib.sha256(full.encode()).hexdigest() == BUNDLE_INFO["full_image_sequence_sha256"]


def test_crops_replacement_copies_the_reference_strings_and_opens_the_range_on_here() -> None:
    _, tok = bundle_and_tokenizer()
    proc = family_for("pil").image
    plan = proc.plan(480, 1500, ItemHints(options=(("do_pan_and_scan", True),)))
    rep = proc.expand(plan)
    full = "\n\n<start_of_image>" + "<image_soft_token>" * 256 + "<end_of_image>\n\n"
    assert rep.text == ("Here is the original image " + full + " and here are some crops to help you see better "
                        + " ".join([full] * 3))
    intro = tok.tokenizer.encode("Here is the original image \n\n", add_special_tokens=False).tokens
    assert intro == ["Here", "▁is", "▁the", "▁original", "▁image", "▁", "\n\n"]
    assert (rep.embed_offset, rep.embed_length, rep.trail) == (len(intro) + 1, 4 * 256, 2)


def test_the_processor_call_adds_a_second_bos_that_the_reference_ids_do_not_have() -> None:
    """Recorded from transformers: ``processor(text=rendered)`` gives ``<bos><bos>...``; the ids
    mmgate reproduces are ``apply_chat_template(tokenize=True)``'s (one ``<bos>``), which is also
    what vLLM's chat path tokenizes."""
    _, tok = bundle_and_tokenizer()
    assert BUNDLE_INFO["processor_call_adds_second_bos"] is True
    ids = tok.encode_prompt("<bos><start_of_turn>user\nhi<end_of_turn>\n")
    assert ids[0] == BUNDLE_INFO["bos_token_id"] and ids[1] != BUNDLE_INFO["bos_token_id"]


def test_two_adjacent_images_share_their_four_newline_token_as_in_vllm() -> None:
    conv = next(c for c in GOLDEN["conversations"] if c["turns"][-1][1][:2] == [0, 1])
    (s0, n0), (s1, _) = conv["vllm_placeholders"]
    assert s0 + n0 - 1 == s1  # one token ("\n\n\n\n") ends the first range and opens the second


# ---------------------------------------------------------------- pan-and-scan arithmetic


@pytest.mark.parametrize(("hw", "expected"), [
    ((480, 640), (1, 2, 480, 320)),  # ratio 1.33 -> round 1 -> at least 2
    ((480, 1500), (1, 3, 480, 500)),  # ratio 3.125 -> 3
    ((400, 1000), (1, 3, 400, 334)),  # ratio 2.5 rounds half up -> 3; ceil(1000 / 3) = 334
    ((100, 5000), None),  # 4 crops of 1250 x 100: height 100 < 256
    ((1200, 300), (4, 1, 300, 300)),  # portrait, ratio 4
    ((2000, 300), (4, 1, 500, 300)),  # ratio 6.7 -> capped at 4
    ((500, 600), (1, 2, 500, 300)),  # ratio exactly 1.2 activates
    ((500, 599), None),  # ratio 1.198 does not
    ((400, 511), (1, 2, 400, 256)),  # crop ceil(511 / 2) = 256: kept
    ((400, 510), None),  # crop 255 < 256
    ((896, 896), None),  # square
])
def test_pan_and_scan_grid_follows_the_reference_arithmetic(hw: tuple[int, int], expected) -> None:
    assert pan_and_scan_grid(hw[0], hw[1], DEFAULTS) == expected


def test_crops_are_cut_where_the_reference_slices_and_the_last_may_be_narrower() -> None:
    from mmgate.models.gemma3 import crop_boxes

    proc = family_for("pil").image
    plan = proc.plan(300, 1001, ItemHints(options=(("do_pan_and_scan", True),)))
    assert plan.detail == (3, 1, 3, 300, 334)
    assert crop_boxes(plan) == [(0, 0, 300, 334), (0, 334, 300, 334), (0, 668, 300, 333)]
    assert plan.shapes == (("pixel_values", (4, 3, 896, 896)), ("num_patches", ()))


def test_settings_that_would_cut_an_empty_crop_are_refused() -> None:
    """W=6, H=1, min crop 1, max 4 crops: crops of ceil(6/4)=2 at 0, 2, 4, 6; the last is empty."""
    proc = family_for("pil").image
    hints = ItemHints(options=options_tuple({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 1}))
    with pytest.raises(GatewayError) as info:
        proc.plan(1, 6, hints)
    assert info.value.code is ErrorCode.INVALID_REQUEST


def test_pan_and_scan_is_off_by_default_as_in_the_bundle() -> None:
    proc = family_for("pil").image
    assert proc.params.pan_and_scan == PanAndScan(False, 256, 4, 1.2)
    assert proc.plan(480, 1500).detail[0] == 0
    assert proc.plan(480, 1500, ItemHints(options=(("do_pan_and_scan", False),))).detail[0] == 0


# ---------------------------------------------------------------- hints


@pytest.mark.parametrize(("options", "param"), [
    ({"do_pan_and_scan": 1}, "mm_processor_kwargs.do_pan_and_scan"),
    ({"do_pan_and_scan": "true"}, "mm_processor_kwargs.do_pan_and_scan"),
    ({"pan_and_scan_min_crop_size": 256.0}, "mm_processor_kwargs.pan_and_scan_min_crop_size"),
    ({"pan_and_scan_min_crop_size": True}, "mm_processor_kwargs.pan_and_scan_min_crop_size"),
    ({"pan_and_scan_min_crop_size": 0}, "mm_processor_kwargs.pan_and_scan_min_crop_size"),
    ({"pan_and_scan_max_num_crops": 0}, "mm_processor_kwargs.pan_and_scan_max_num_crops"),
    ({"pan_and_scan_max_num_crops": 17}, "mm_processor_kwargs.pan_and_scan_max_num_crops"),
    ({"pan_and_scan_min_ratio_to_activate": "1.5"}, "mm_processor_kwargs.pan_and_scan_min_ratio_to_activate"),
    ({"pan_and_scan_min_ratio_to_activate": False}, "mm_processor_kwargs.pan_and_scan_min_ratio_to_activate"),
    ({"pan_and_scan_min_ratio_to_activate": float("nan")}, "mm_processor_kwargs.pan_and_scan_min_ratio_to_activate"),
    ({"max_pixels": 1000}, "mm_processor_kwargs.max_pixels"),
    ({"do_pan_and_scan": True, "num_crops": 2}, "mm_processor_kwargs.num_crops"),
])
def test_unknown_or_ill_typed_mm_processor_kwargs_are_refused_naming_the_key(options: dict, param: str) -> None:
    proc = family_for("pil").image
    with pytest.raises(GatewayError) as info:
        proc.check_hints(ItemHints(options=options_tuple(options)), "messages[0].content[1]")
    assert info.value.code is ErrorCode.INVALID_REQUEST
    assert info.value.param == param


def test_max_long_side_pixel_is_refused_on_the_item() -> None:
    proc = family_for("pil").image
    with pytest.raises(GatewayError) as info:
        proc.check_hints(ItemHints(max_long_side_pixel=448), "messages[0].content[1]")
    assert info.value.code is ErrorCode.INVALID_REQUEST and info.value.param == "messages[0].content[1].max_long_side_pixel"


def test_every_pan_and_scan_kwarg_is_taken_per_request() -> None:
    proc = family_for("pil").image
    options = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 100, "pan_and_scan_max_num_crops": 8,
               "pan_and_scan_min_ratio_to_activate": 2}  # an integer ratio is a number, as in JSON
    hints = ItemHints(options=options_tuple(options))
    proc.check_hints(hints, "messages[0].content[0]")
    assert proc.pan_and_scan(hints) == PanAndScan(True, 100, 8, 2.0)
    assert proc.plan(100, 1000, hints).detail == (8, 1, 8, 100, 125)  # ratio 10 -> min(10, 10) -> 8


# ---------------------------------------------------------------- wire layout and registry


def test_specs_follow_vllm_gemma3_mm_fields_config() -> None:
    """vLLM ``gemma3_mm.py`` (0.33 line) ``_get_mm_fields_config``: ``pixel_values``
    ``flat_from_sizes("image", num_patches)``, ``num_patches`` (= crops + 1) batched, nothing on CPU;
    no ``num_crops`` (transformers' ``Gemma3Processor`` pops it, vLLM's processor never declares it)."""
    proc = family_for("pil").image
    layout = {s.name: (s.layout, s.sizes_key, s.keep_on_cpu, s.primary, s.dtype) for s in proc.specs}
    assert layout == {
        "pixel_values": (TensorLayout.FLAT, "num_patches", False, True, "float32"),
        "num_patches": (TensorLayout.BATCHED, None, False, False, "int64"),
    }
    assert proc.anchor_token_id == BUNDLE_INFO["boi_token_id"]
    assert proc.placeholder_token_id == BUNDLE_INFO["image_token_id"]


def test_a_batch_of_items_with_and_without_crops_is_laid_out_flat() -> None:
    proc = family_for("pil").image
    hints = ItemHints(options=(("do_pan_and_scan", True),))
    items = [decoded("gemma3", n) for n in ("rgb_640x480", "tiny_1x1", "uneven_1001x300")]
    plans = [proc.plan(im.height, im.width, hints) for im in items]
    shares = [proc.preprocess(im, pl) for im, pl in zip(items, plans)]
    batch = assemble(proc, plans, shares)
    assert batch.tensors["pixel_values"].shape == (3 + 1 + 4, 3, 896, 896)
    assert set(batch.tensors) == {"pixel_values", "num_patches"}
    assert batch.tensors["num_patches"].tolist() == [3, 1, 4]
    assert batch.flat_keys == {"pixel_values": "num_patches"} and batch.keep_on_cpu_keys == ()
    assert np.array_equal(batch.tensors["pixel_values"][3:4], shares[1])


def test_raw_pixels_are_the_resized_bytes_in_the_same_layout() -> None:
    proc = family_for("pil").image
    image = decoded("gemma3", "exact_896x896")
    plan = proc.plan(image.height, image.width)
    raw = proc.preprocess(image, plan, raw=True)
    assert raw.dtype == np.uint8 and raw.shape == (1, 3, 896, 896)
    assert np.array_equal(raw[0], np.moveaxis(image.pixels, 2, 0))


def test_registry_serves_gemma3_with_images_only_and_reserves_its_media_tokens() -> None:
    family = family_for("pil")
    assert FAMILY_BY_MODEL_TYPE["gemma3"] is Gemma3Family
    assert family.video is None and set(family.limits) == {Modality.IMAGE}
    assert family.reserved_tokens == ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
    assert family_for("pil").fingerprint != family_for("torchvision").fingerprint


def test_vllm_placeholder_port_on_a_worked_example() -> None:
    """``\\n``=1, ``\\n\\n``=2, ``\\n\\n\\n``=3, ``\\n\\n\\n\\n``=4; two items ``[2, 9, 2]`` in
    ``[7, 3, 9, 4, 9, 2]``: the first opens on the merged 3, the second on the shared 4."""
    ids = [7, 3, 9, 4, 9, 2]
    assert vllm_placeholders(ids, [[2, 9, 2], [2, 9, 2]], (1, 2, 3, 4)) == [(1, 3), (3, 3)]
    assert replacement_ranges(ids, 9, [(1, 1, 1), (1, 1, 1)]) == [(1, 3), (3, 3)]
