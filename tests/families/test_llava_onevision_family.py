"""The LLaVA-OneVision family's own checks, without the reference.

The golden replay of ``golden/llava_onevision.json`` is ``test_golden_replay.py``'s; the live tier is
``test_llava_onevision_live_parity.py``.  Here: the wire specs (vLLM 0.33 ``_get_mm_fields_config``),
the registry dispatch and limits, hint refusals, the bundle checks, the reserved tokens and the ported
arithmetic on worked examples (each written out).
"""

from __future__ import annotations

import dataclasses
import math
from functools import cache

import numpy as np
import pytest
from replay import bundle_and_tokenizer

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.models.llava_onevision import LlavaOnevisionFamily, max_patches_of, onevision_features
from mmgate.models.llava_onevision_video import OnevisionVideo
from mmgate.models.registry import FAMILY_BY_MODEL_TYPE, load_family
from mmgate.types import DecodedVideo, ItemHints, Modality, TensorLayout, VideoMeta

BUNDLE = "llava-hf--llava-onevision-qwen2-0.5b-ov-hf"


@cache
def family(backend: str = "pil", sampling: FrameSampling = FrameSampling.VLLM) -> LlavaOnevisionFamily:
    bundle, tok = bundle_and_tokenizer(BUNDLE)
    return LlavaOnevisionFamily.from_bundle(bundle, tok, ImageBackend(backend), video_sampling=sampling)


def test_specs_follow_vllm_llava_onevision_mm_fields_config() -> None:
    """vLLM 0.33: ``pixel_values``, ``image_sizes`` batched("image"); ``pixel_values_videos``
    batched("video") (sent as the video batch's ``pixel_values``); none kept on CPU."""
    fam = family()
    assert [(s.name, s.dtype, s.layout, s.keep_on_cpu, s.primary) for s in fam.image.specs] == [
        ("pixel_values", "float32", TensorLayout.BATCHED, False, True),
        ("image_sizes", "int64", TensorLayout.BATCHED, False, False)]
    assert fam.video is not None
    assert [(s.name, s.dtype, s.layout, s.keep_on_cpu, s.primary) for s in fam.video.specs] == [
        ("pixel_values", "float32", TensorLayout.BATCHED, False, True)]
    assert (fam.image.placeholder_token_id, fam.video.placeholder_token_id) == (151646, 151647)
    assert fam.image.anchor_token_id == 151646 and fam.video.anchor_token_id == 151647


def test_registry_dispatch_limits_and_reserved_tokens() -> None:
    bundle, tok = bundle_and_tokenizer(BUNDLE)
    assert FAMILY_BY_MODEL_TYPE["llava_onevision"] is LlavaOnevisionFamily
    fam = load_family(bundle, tok, ImageBackend.AUTO)
    assert isinstance(fam, LlavaOnevisionFamily) and fam.image.backend is ImageBackend.TORCHVISION
    # 16 images (32768 // 729 = 44 would fit), one video
    assert fam.limits == {Modality.IMAGE: 16, Modality.VIDEO: 1}
    assert fam.reserved_tokens == ("<image>", "<video>")
    assert not fam.mrope


@pytest.mark.parametrize(("hints", "param"), [
    (ItemHints(max_long_side_pixel=500), "p.max_long_side_pixel"),
    (ItemHints(options=(("do_pad", False),)), "mm_processor_kwargs"),
])
def test_image_hints_are_refused(hints: ItemHints, param: str) -> None:
    with pytest.raises(GatewayError) as info:
        family().image.check_hints(hints, "p")
    assert info.value.code is ErrorCode.INVALID_REQUEST and info.value.param == param


@pytest.mark.parametrize(("hints", "param"), [
    (ItemHints(fps=1.0), "p.fps"),
    (ItemHints(max_long_side_pixel=500), "p.max_long_side_pixel"),
    (ItemHints(options=(("num_frames", 8),)), "mm_processor_kwargs"),
])
def test_video_hints_are_refused(hints: ItemHints, param: str) -> None:
    video = family().video
    assert video is not None
    with pytest.raises(GatewayError) as info:
        video.check_hints(hints, "p")
    assert info.value.code is ErrorCode.INVALID_REQUEST and info.value.param == param


@pytest.mark.parametrize(("hw", "tokens"), [
    # (h, w) -> tokens, written out (27 patches a tile side, 729 base, anyres_max_9):
    # 480x640: pinpoint 768x768 (2x2) -> 54x54 grid; 640/480 > 1: new_h = int(round(480 * 54 / 640, 7)) = 40,
    #   pad (54 - 40) // 2 = 7 -> 40x54 unpadded, ratio sqrt(2160 / 6561) < 1.1: 2160 + 40 + 729
    ((480, 640), 2160 + 40 + 729),
    # 1x1: pinpoint 384x384 -> 27x27, aspect equal: new_w = 27, no padding: 729 + 27 + 729
    ((1, 1), 729 + 27 + 729),
    # 1000x2000: pinpoint 1152x2304 (3x6) -> 81x162; new_h = int(round(1000 * 162 / 2000, 7)) = 81: no padding;
    #   ratio sqrt(81 * 162 / 6561) = 1.414 > 1.1: int(81 // 1.414) = 57, int(162 // 1.414) = 114
    ((1000, 2000), 57 * 114 + 57 + 729),
])
def test_token_count_on_worked_examples(hw: tuple[int, int], tokens: int) -> None:
    assert family().image.num_tokens(*hw) == tokens


def test_the_anyres_max_cap_applies_only_above_ratio_1_1() -> None:
    # a 3x3 grid is 81x81 features: ratio sqrt(6561 / 6561) = 1.0, kept
    assert onevision_features(1152, 1152, 27, 3, 3, 9) == (81 * 81, 81)
    # 3x4 (81x108): ratio sqrt(8748 / 6561) = 1.155 > 1.1 -> int(81 // 1.155) = 70, int(108 // 1.155) = 93
    ratio = math.sqrt(81 * 108 / (9 * 27 * 27))
    assert ratio > 1.1
    assert onevision_features(1152, 1536, 27, 3, 4, 9) == (int(81 // ratio) * int(108 // ratio), int(81 // ratio))


def test_vision_aspect_ratio_is_read_as_the_processor_strips_it() -> None:
    assert max_patches_of("anyres_max_9", "b") == 9 and max_patches_of("anyres_max_16", "b") == 16
    with pytest.raises(GatewayError) as info:
        max_patches_of("anyres", "b")
    assert info.value.code is ErrorCode.INTERNAL_ERROR


def test_a_bundle_with_another_image_processor_or_a_crop_is_refused() -> None:
    bundle, tok = bundle_and_tokenizer(BUNDLE)
    other = dataclasses.replace(bundle, preprocessor_config={**bundle.preprocessor_config,
                                                             "image_processor_type": "LlavaNextImageProcessor"})
    with pytest.raises(GatewayError) as info:
        LlavaOnevisionFamily.from_bundle(other, tok, ImageBackend.PIL)
    assert info.value.code is ErrorCode.INTERNAL_ERROR
    cropped = dataclasses.replace(bundle, preprocessor_config={**bundle.preprocessor_config,
                                                               "crop_size": {"height": 336, "width": 336}})
    with pytest.raises(GatewayError):
        LlavaOnevisionFamily.from_bundle(cropped, tok, ImageBackend.PIL)


def _clip(frames: int) -> DecodedVideo:
    meta = VideoMeta(total_frames=frames, fps=25.0, height=32, width=48, codec="h264", container="mp4")
    return DecodedVideo(frames=np.zeros((frames, 32, 48, 3), dtype=np.uint8), meta=meta,
                        frame_indices=tuple(range(frames)), rotation=0, content_hash="0", num_bytes=1)


@pytest.mark.parametrize(("sampling", "total", "kept"), [
    (FrameSampling.VLLM, 7, list(range(7))),
    (FrameSampling.VLLM, 301, [int(i) for i in np.linspace(0, 300, 32, dtype=int)]),
    (FrameSampling.TRANSFORMERS, 301, list(range(301))),
])
def test_frames_kept_per_sampling_rule(sampling: FrameSampling, total: int, kept: list[int]) -> None:
    video = family(sampling=sampling).video
    assert isinstance(video, OnevisionVideo)
    assert video.sample(_clip(total).meta, ItemHints()) == kept


def test_a_clip_plans_196_tokens_a_frame_and_one_newline_all_embedded() -> None:
    video = family().video
    assert video is not None
    plan = video.plan(_clip(7), ItemHints())
    assert plan.num_tokens == 7 * 196 + 1  # ceil(27 / 2)^2 per frame
    assert plan.primary_shape == (7, 3, 384, 384)
    rep = video.expand(plan)
    assert rep.token_ids == (151647,) * (7 * 196 + 1) and (rep.embed_offset, rep.embed_length) == (0, 7 * 196 + 1)
    raw = video.preprocess(_clip(7), plan, raw=True)
    assert raw.dtype == np.uint8 and raw.shape == (7, 3, 384, 384) and not raw.any()
    assert np.all(video.preprocess(_clip(1), video.plan(_clip(1), ItemHints())) == -1.0)  # (0 - 0.5) / 0.5
