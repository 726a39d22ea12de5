"""Prompt layout per family, the anchoring of a clip's placeholder range, and timestamp tokenization."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mmgate.models.qwen_vl_frames import qwen3_timestamps
from tests.video.video_support import (
    QWEN2,
    QWEN2_5,
    QWEN3,
    ClipSpec,
    make_clip,
    pipeline,
    prepare,
    processor,
    reference,
    video_part,
)


@pytest.fixture(scope="module")
def clip_8_frames_4_fps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clip(ClipSpec("f8_4fps_320x256", 8, 4, 320, 256), tmp_path_factory.mktemp("layout"))


def test_qwen3_eight_frame_four_fps_clip_is_two_timestamped_blocks_inside_the_template_markers(
        clip_8_frames_4_fps: Path) -> None:
    """Sampled at 2 fps: int(8 / 4 * 2) = 4 frames, linspace(0, 7, 4).round() = [0, 2, 5, 7]; temporal
    patches (0, 2) and (5, 7) are stamped (0/4 + 2/4) / 2 = 0.25 -> "0.2" and (5/4 + 7/4) / 2 = 1.5;
    a 320x256 frame is 20x16 patches = 80 merged tokens."""
    prepared = prepare(QWEN3, [video_part(clip_8_frames_4_fps)])
    text = pipeline(QWEN3).runtime.tokenizer.tokenizer.decode(list(prepared.input_ids), skip_special_tokens=False)
    block = "<|vision_start|>" + "<|video_pad|>" * 80 + "<|vision_end|>"
    expected = f"<|vision_start|><0.2 seconds>{block}<1.5 seconds>{block}<|vision_end|>"
    assert expected in text
    ref = reference(QWEN3, clip_8_frames_4_fps)
    assert ref.indices == [0, 2, 5, 7]
    assert expected in processor(QWEN3).tokenizer.decode(ref.input_ids)
    assert prepared.input_ids == tuple(ref.input_ids)


def test_qwen3_placeholder_range_spans_the_whole_replacement_and_only_pads_take_embeddings(
        clip_8_frames_4_fps: Path) -> None:
    prepared = prepare(QWEN3, [video_part(clip_8_frames_4_fps)])
    (batch,) = prepared.batches
    (rng,) = batch.placeholders
    ids = np.array(prepared.input_ids)
    inside = ids[rng.offset:rng.offset + rng.length]
    vision_start = pipeline(QWEN3).runtime.tokenizer.token_id("<|vision_start|>")
    vision_end = pipeline(QWEN3).runtime.tokenizer.token_id("<|vision_end|>")
    assert ids[rng.offset - 1] == vision_start and ids[rng.offset + rng.length] == vision_end  # the template's own
    assert inside[-1] == vision_end  # the last frame's marker
    # The engine's is_embed (SMG: ids == im_token_id) selects exactly the model's video tokens.
    assert batch.placeholder_token_id == pipeline(QWEN3).runtime.family.video.video_token_id
    assert int((inside == batch.placeholder_token_id).sum()) == int((ids == batch.placeholder_token_id).sum()) == 160
    assert prepared.plans[0].num_tokens == 160


@pytest.mark.parametrize("model", [QWEN2, QWEN2_5])
def test_qwen2_families_expand_one_pad_run_that_is_the_placeholder_range(model: str, clips: dict[str, Path]) -> None:
    prepared = prepare(model, [video_part(clips["f17_25fps_mpeg4"])])
    (batch,) = prepared.batches
    (rng,) = batch.placeholders
    ids = np.array(prepared.input_ids)
    pads = np.flatnonzero(ids == batch.placeholder_token_id)
    assert rng.offset == pads[0] and rng.length == len(pads) == pads[-1] - pads[0] + 1
    grid_t, gh, gw = batch.tensors["video_grid_thw"][0]
    assert rng.length == grid_t * gh * gw // 4


def test_timestamp_ids_alone_equal_their_ids_in_the_whole_prompt() -> None:
    """The reference tokenizes the expanded prompt as one string; a timestamp sits between added special
    tokens, so tokenizing it alone (what mmgate caches) gives the same ids, for any value."""
    tok = processor(QWEN3).tokenizer
    video = pipeline(QWEN3).runtime.family.video
    block = "<|vision_start|><|video_pad|><|vision_end|>"
    seconds = [i / 10 for i in range(0, 2000, 7)] + [59.95, 99.96, 999.94, 1234.5, 36000.0, 86399.9]
    text = "<|im_start|>user\n<|vision_start|>" + "".join(f"<{s:.1f} seconds>{block}" for s in seconds) + \
        "<|vision_end|>What happens?<|im_end|>\n"
    whole = tok(text, add_special_tokens=False)["input_ids"]
    pieces = tok("<|im_start|>user\n<|vision_start|>", add_special_tokens=False)["input_ids"]
    for s in seconds:
        pieces += list(video._timestamp(s)) + [video.vision_start_id, video.video_token_id, video.vision_end_id]
    pieces += tok("<|vision_end|>What happens?<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert pieces == whole


def test_timestamps_average_the_first_and_last_frame_of_each_temporal_patch() -> None:
    # indices [0, 2, 5] at 4 fps: padded to [0, 2, 5, 5] -> (0 + 0.5) / 2, (1.25 + 1.25) / 2
    assert qwen3_timestamps([0, 2, 5], 4.0, 2) == [0.25, 1.25]
    assert processor(QWEN3)._calculate_timestamps([0, 2, 5], 4.0, 2) == [0.25, 1.25]
