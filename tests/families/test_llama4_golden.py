"""What only the Llama 4 family has: the bfloat16 normalize table, the canvas set, the token run, its
single backend, refused options.  Expected values come from transformers 5.24 (``Llama4ImageProcessor``,
``Llama4Processor``) or from arithmetic written out here; the golden rows themselves are replayed by
``test_golden_replay.py``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
from parity_support import ImageSpec, find_bundle_dir

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.image import decode_image
from mmgate.models.backend import ImageBackend
from mmgate.models.bundle import load_bundle
from mmgate.models.family import assemble
from mmgate.models.llama4 import Llama4Images, bf16_normalize_lut, best_fit, supported_resolutions
from mmgate.models.registry import load_family
from mmgate.types import ItemHints

BUNDLE = "meta-llama--Llama-4-Scout-17B-16E-Instruct"
PATCH, IMAGE, START, END, TILE_X, TILE_Y = 200092, 200090, 200080, 200081, 200084, 200085


@cache
def images(backend: ImageBackend = ImageBackend.TORCHVISION) -> Llama4Images:
    path = find_bundle_dir(BUNDLE)
    if path is None:
        pytest.skip(f"model bundle {BUNDLE} not on the model search path")
    bundle = load_bundle(Path(path))
    family = load_family(bundle, load_tokenizer(bundle), backend)
    assert family is not None
    return family.image


@pytest.mark.parametrize(("mean", "std"), [((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
                                           ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])
def test_the_bfloat16_table_is_torchs_rescale_and_normalize_on_every_byte(mean: tuple, std: tuple) -> None:
    torch = pytest.importorskip("torch")
    from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor

    ip = Llama4ImageProcessor(image_mean=list(mean), image_std=list(std))
    x = torch.arange(256, dtype=torch.uint8).repeat(3, 1).reshape(1, 3, 16, 16)
    ref = ip.rescale_and_normalize(x, True, 1 / 255, True, list(mean), list(std))
    assert ref.dtype == torch.bfloat16
    table = bf16_normalize_lut(1 / 255, mean, std, True, True)
    assert np.array_equal(table, ref.float().numpy()[0].reshape(3, 256))


def test_canvases_are_the_references_in_its_order() -> None:
    pytest.importorskip("torch")
    from transformers.image_utils import SizeDict
    from transformers.models.llama4.image_processing_llama4 import find_supported_resolutions

    for chunks, tile in ((4, 224), (16, 336), (5, 14)):
        ref = find_supported_resolutions.__wrapped__(chunks, SizeDict(height=tile, width=tile))
        assert supported_resolutions(chunks, tile) == tuple(tuple(r) for r in ref)
    # the reference docstring's example: 4 chunks of 224
    assert supported_resolutions(4, 224) == ((224, 896), (448, 448), (224, 224), (896, 224), (224, 672),
                                             (672, 224), (224, 448), (448, 224))
    assert len(supported_resolutions(16, 336)) == sum(
        1 for n in range(1, 17) for f in range(1, n + 1) if n % f == 0)  # every factor pair of 1..16


def test_best_fit_worked_examples() -> None:
    five = ((224, 672), (672, 224), (224, 448), (448, 224), (224, 224))
    # get_best_fit's docstring: 200x300 upscales by 1.12 to 224x448 or 672x224; the smaller area wins
    assert best_fit(200, 300, five) == (224, 448)
    # 336x336 fits one tile exactly (scale 1); 337x336 (h x w) needs the next canvas up: 2x1 tiles, 672x336
    canvases = supported_resolutions(16, 336)
    assert best_fit(336, 336, canvases) == (336, 336)
    assert best_fit(337, 336, canvases) == (672, 336)
    # 1345x1344: no canvas holds it unscaled; the least downscaling is 4x4 (1344 / 1345)
    assert best_fit(1345, 1344, canvases) == (1344, 1344)


def test_a_2x2_canvas_is_720_patch_tokens_in_a_run_of_727() -> None:
    proc = images()
    plan = proc.plan(480, 640)
    assert plan.detail == (2, 2) and plan.num_tokens == (4 + 1) * 144
    run = proc.expand(plan).token_ids
    patches = (PATCH,) * 144
    row = patches + (TILE_X,) + patches + (TILE_Y,)
    assert run == (START, *row, *row, IMAGE, *patches, END)
    assert len(run) == 727 and proc.expand(plan).embed_length == 727


def test_a_one_tile_image_has_no_separators_and_no_global_tile() -> None:
    proc = images()
    plan = proc.plan(48, 64)
    assert plan.detail == (1, 1) and plan.primary_shape == (1, 3, 336, 336) and plan.num_tokens == 144
    assert proc.expand(plan).token_ids == (START, IMAGE, *(PATCH,) * 144, END)


def test_every_image_backend_gives_the_one_references_values() -> None:
    """transformers has no PIL Llama 4 image processor: ``pil`` and ``auto`` compute the torchvision
    values (docs/parity.md, "Llama 4")."""
    decoded = decode_image(ImageSpec(700, 400, "RGB", 3).encode(), 10**9)
    shares = []
    for backend in (ImageBackend.PIL, ImageBackend.AUTO, ImageBackend.TORCHVISION):
        proc = images(backend)
        plan = proc.plan(decoded.height, decoded.width)
        shares.append(assemble(proc, [plan], [proc.preprocess(decoded, plan)]).tensors["pixel_values"])
    assert all(np.array_equal(s, shares[-1]) for s in shares)
    assert images(ImageBackend.PIL).fingerprint == images(ImageBackend.TORCHVISION).fingerprint


def test_raw_pixels_are_the_padded_tiles_and_the_global_tile() -> None:
    proc = images()
    decoded = decode_image(ImageSpec(337, 336, "RGB", 4).encode(), 10**9)
    plan = proc.plan(decoded.height, decoded.width)
    raw = proc.preprocess(decoded, plan, raw=True)
    assert raw.dtype == np.uint8 and raw.shape == (3, 3, 336, 336)  # 1x2 canvas + the global tile
    assert not raw[1, :, :, 1:].any()  # the second tile holds one column of the image, the rest padding


@pytest.mark.parametrize("hints", [ItemHints(options=(("max_patches", 4),)),
                                   ItemHints(options=(("resize_to_max_canvas", True),)),
                                   ItemHints(max_long_side_pixel=512)])
def test_per_request_options_are_refused(hints: ItemHints) -> None:
    with pytest.raises(GatewayError) as info:
        images().check_hints(hints, "messages[0].content[0]")
    assert info.value.code is ErrorCode.INVALID_REQUEST
