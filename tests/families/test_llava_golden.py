"""The LLaVA-1.5 and LLaVA-NeXT families' own checks, without the reference.

The golden replay of ``golden/llava.json`` and ``golden/llava_next.json`` (pixel rows, decodes,
conversations with their placeholder ranges, the torch-free pil row) is
``test_golden_replay.py``'s (``replay.llava_row`` / ``replay.llava_conversation``).  Here: wire
specs (vLLM ``_get_mm_fields_config``), NeXT's zero-padded batch, the raw share, hint refusals,
the resize bound, limits, the registry dispatch and the ported arithmetic on worked examples.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from parity_support import ImageSpec
from replay import bundle_and_tokenizer, golden

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.image import decode_image
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
from mmgate.config.settings import FetchSettings
from mmgate.models.backend import ImageBackend
from mmgate.types import ItemHints, Modality, TensorLayout

GOLDENS = {name: golden(name) for name in ("llava", "llava_next")}
FAMILY_CLASSES = {"llava": LlavaFamily, "llava_next": LlavaNextFamily}
MAX_DECODE_PIXELS = FetchSettings().max_image_pixels


@cache
def family_for(name: str, backend: str):
    bundle, tok = bundle_and_tokenizer(GOLDENS[name]["bundles"][0]["bundle"])
    return FAMILY_CLASSES[name].from_bundle(bundle, tok, ImageBackend(backend))


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


