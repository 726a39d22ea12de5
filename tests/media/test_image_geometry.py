"""Tiny images and extreme aspect ratios go through ``smart_resize`` exactly as the reference.

For each size: the transformers 5.24 image processor (both backends, fed
``PIL.Image.open(BytesIO(png))``) either returns ``pixel_values`` and
``image_grid_thw`` — and mmgate's decode + ``plan`` + ``preprocess_one`` must
return the same grid and bit-identical values — or raises ``ValueError``
(aspect ratio over 200), where mmgate must refuse with
``image_aspect_ratio_invalid`` (400).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.image import decode_image
from mmgate.models.qwen_vl import QwenVLFamily, QwenVLImage, image_params_from_config
from mmgate.models.backend import ImageBackend

#: processor values of the corpus profiles (transformers class defaults for qwen2_vl)
PROFILES: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 56 * 56,
                 "max_pixels": 28 * 28 * 1280},
    "qwen3_vl": {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 65536,
                 "max_pixels": 16777216, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
}

SIZES = [  # (width, height)
    (1, 1), (2, 1), (1, 3), (3, 1), (150, 1), (200, 1), (201, 1), (1, 201), (500, 3), (3, 500), (500, 19),
    (28, 26), (332, 27), (257, 27), (305, 30), (1000, 5), (5, 1000), (1093, 5), (5, 1093), (56, 56), (27, 27),
    (2000, 11), (13, 2600),
]


def _png(width: int, height: int) -> bytes:
    rng = np.random.default_rng(width * 7919 + height)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _reference(profile: str, backend: ImageBackend) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
        Qwen2VLImageProcessor,
    )

    cls = Qwen2VLImageProcessor if backend is ImageBackend.TORCHVISION else Qwen2VLImageProcessorPil
    return cls(**PROFILES[profile])


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, ImageBackend], Any]:
    return {(p, b): _reference(p, b) for p in PROFILES for b in (ImageBackend.PIL, ImageBackend.TORCHVISION)}


@pytest.mark.parametrize("backend", [ImageBackend.PIL, ImageBackend.TORCHVISION], ids=lambda b: b.value)
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_odd_sizes_match_the_reference_or_are_refused_where_it_refuses(
        profile: str, backend: ImageBackend, references: dict) -> None:
    family = QwenVLFamily(profile, QwenVLImage(profile, image_params_from_config(PROFILES[profile]), 151655, backend))
    ref_processor = references[(profile, backend)]
    for width, height in SIZES:
        data = _png(width, height)
        try:
            ref = ref_processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")
        except ValueError as exc:
            assert "aspect ratio" in str(exc)
            with pytest.raises(GatewayError) as err:
                family.image.plan(height, width)
            assert err.value.code is ErrorCode.IMAGE_ASPECT_RATIO_INVALID and err.value.status == 400
            continue
        image = decode_image(data, 10**8)
        plan = family.image.plan(image.height, image.width)
        assert list(plan.detail) == ref["image_grid_thw"][0].tolist(), (width, height)
        assert plan.num_tokens == int(np.prod(plan.detail)) // 4
        rows = family.image.preprocess(image, plan)
        expected = np.asarray(ref["pixel_values"])
        assert rows.shape == expected.shape, (width, height)
        assert np.array_equal(rows, expected), f"{width}x{height}: max diff {np.abs(rows - expected).max()}"


def test_tiny_image_is_upscaled_to_one_merged_patch_or_more() -> None:
    family = QwenVLFamily("qwen2_vl", QwenVLImage("qwen2_vl", image_params_from_config(PROFILES["qwen2_vl"]), 151655, ImageBackend.PIL))
    plan = family.image.plan(1, 1)
    # smart_resize(1, 1, 28, 3136, ...): round(1/28)*28 = 0 -> area 0 < 3136 -> beta = sqrt(3136) = 56
    # -> ceil(1 * 56 / 28) * 28 = 56 per side -> grid 4 x 4 -> 16 patches / merge 2x2 = 4 tokens
    assert plan.resized_hw == (56, 56) and plan.detail == (1, 4, 4) and plan.num_tokens == 4
