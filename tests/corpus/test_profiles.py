"""The corpus profiles' bundles, checked against transformers without starting a stack.

The Qwen profiles' video configs set ``do_sample_frames`` as the corpus says, and the gateway follows it.
The ``llava_1_5`` profile's numbers (``make_cases.py`` ``PROFILES``: shortest edge 336,
crop 336, patch 14, ``tokens_per_image`` 576) must be what the bundle the runner builds for it
gives the transformers 5.24 processor, so that a case's expected shapes and the reference pixels
agree with each other before any request is judged.
"""

from __future__ import annotations

import json
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


def test_qwen_profile_bundles_set_do_sample_frames_and_the_qwen2_one_passes_frames_as_is(tmp_path: Path) -> None:
    """The BH-14 cases expect Qwen2-VL clips passed as-is (``make_cases.py`` ``qwen2_video_expect``:
    ``do_sample_frames=False``).  The profile bundles write ``do_sample_frames`` into their video config,
    and an explicit setting is followed under the gateway's default ``--video-frame-sampling vllm``,
    which would otherwise sample 2 fps: the 5-frame 2 fps clip keeps its 5 frames, as the transformers
    processor built from that bundle does, and plans the case's ``video_grid_thw``."""
    from transformers import AutoProcessor

    from mmgate.chat.tokenizer import load_tokenizer
    from mmgate.media.video import decode_video
    from mmgate.models.bundle import load_bundle
    from mmgate.models.registry import load_family
    from mmgate.models.backend import FrameSampling, ImageBackend
    from mmgate.types import ItemHints

    corpus = load_corpus()
    for profile in ("qwen2_vl", "qwen3_vl"):
        values = corpus.profiles[profile]
        folder = profile_bundle(model_roots()[0], tmp_path / profile, profile, values)
        written = json.loads((folder / "video_preprocessor_config.json").read_text())
        assert written["do_sample_frames"] is values["video_do_sample_frames"]
    folder = tmp_path / "qwen2_vl" / "corpus--qwen2_vl"
    assert AutoProcessor.from_pretrained(folder).video_processor.do_sample_frames is False
    bundle = load_bundle(folder)
    family = load_family(bundle, load_tokenizer(bundle), ImageBackend.TORCHVISION, video_sampling=FrameSampling.VLLM)
    assert family is not None and family.video is not None
    (case,) = [c for c in corpus.cases if c["id"] == "BH-14-frames5"]
    clip = decode_video(corpus.file(case["files"][0]), lambda meta: family.video.sample(meta, ItemHints()), None, 30.0)
    assert list(clip.frame_indices) == [0, 1, 2, 3, 4]
    assert [list(family.video.plan(clip, ItemHints()).detail.geometry)] == case["expected"]["video_grid_thw"]
