"""The corpus profiles' bundles, checked against transformers without starting a stack.

The ``llava_1_5`` profile's numbers (``make_cases.py`` ``PROFILES``: shortest edge 336,
crop 336, patch 14, ``tokens_per_image`` 576) must be what the bundle the runner builds for it
gives the transformers 5.24 processor, so that a case's expected shapes and the reference pixels
agree with each other before any request is judged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from tests.conftest import model_roots
from tests.corpus.cases import (
    BASE_PROFILE,
    SUPPORTED_PROFILES,
    load_corpus,
    profiles_in_use,
)
from tests.corpus.stack import CROP_PROFILES, PROFILE_BASE, profile_bundle


def test_llava_profile_bundle_gives_the_profile_crop_and_token_count(tmp_path: Path) -> None:
    from transformers import AutoProcessor

    values = load_corpus().profiles["llava_1_5"]
    processor = AutoProcessor.from_pretrained(profile_bundle(model_roots()[0], tmp_path, "llava_1_5", values))
    image = processor.image_processor
    assert type(image).__name__ == "CLIPImageProcessor"
    assert dict(image.size) == {"shortest_edge": values["shortest_edge"]}
    assert (image.crop_size["height"], image.crop_size["width"]) == (values["crop"], values["crop"])
    assert processor.patch_size == values["patch_size"]
    wide = Image.fromarray(np.zeros((30, 500, 3), np.uint8))
    out = processor(text=["USER: <image>\nHi ASSISTANT:"], images=[wide], return_tensors="np")
    assert out["pixel_values"].shape == (1, 3, values["crop"], values["crop"])
    assert int((out["input_ids"] == 32000).sum()) == values["tokens_per_image"] == (336 // 14) ** 2


def test_the_stack_starts_the_base_profile_and_every_supported_profile_a_case_names() -> None:
    corpus = load_corpus()
    named = {c["model_profile"] for c in corpus.cases}
    assert set(profiles_in_use(corpus)) == (named & set(SUPPORTED_PROFILES)) | {BASE_PROFILE}
    assert set(SUPPORTED_PROFILES) <= set(PROFILE_BASE) and set(CROP_PROFILES) <= set(SUPPORTED_PROFILES)
    assert set(SUPPORTED_PROFILES) <= set(corpus.profiles)  # every served profile's values come from the corpus
