"""Tier (a) for LLaVA-OneVision video: the ``clips`` of ``golden/llava_onevision.json`` replayed
without transformers.

Per clip (1, 2, 7, 33, 301 frames, remade with ``tests/video/video_support.make_clip``) and frame
sampling rule: every frame mmgate decodes (``decode_video``) has the RGB bytes transformers' pyav
loader decoded (else the encoder or decoder changed, not mmgate); the family keeps the recorded
frames (``sample``); through the pipeline (``video_support.prepare``, template + tokenizer + family)
the ids and the clip's ``pixel_values`` (vLLM's ``pixel_values_videos``) have the recorded sha256, or
the request is refused where the recorded expansion passes the context.  The fixture is written by
``scripts/gen_golden.py --family llava_onevision`` (builder ``scripts/golden_llava_onevision.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from parity_support import sha256_f32le, sha256_ids, sha256_rgb
from replay import golden, versions_note

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.backend import FrameSampling
from mmgate.types import ItemHints

pytest.importorskip("av")

MODEL = "llava-hf/llava-onevision-qwen2-0.5b-ov-hf"
ROWS = golden("llava_onevision")["clips"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("onevision_golden_clips")


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r['clip']['frames']}frames-{r['sampling']}")
def test_clip_replays_to_the_recorded_frames_ids_and_pixels(row: dict, clip_dir: Path) -> None:
    from mmgate.media.video import decode_video
    from tests.video.video_support import ClipSpec, make_clip, pipeline, prepare, video_part

    c = row["clip"]
    path = make_clip(ClipSpec(f"ov_f{c['frames']}", c["frames"], c["fps"], c["width"], c["height"], c["codec"]),
                     clip_dir)
    every = decode_video(path.read_bytes(), lambda meta: list(range(meta.total_frames)), None, 60.0)
    note = versions_note("llava_onevision")
    assert sha256_rgb(every.frames) == row["frames_rgb_sha256"], f"decoded frames differ {note}"
    sampling = FrameSampling(row["sampling"])
    video = pipeline(MODEL, sampling).runtime.family.video
    assert video.sample(every.meta, ItemHints()) == row["frames_kept"]
    if "refused" in row:
        with pytest.raises(GatewayError) as info:
            prepare(MODEL, [video_part(path)], sampling=sampling)
        assert info.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
        return
    prepared = prepare(MODEL, [video_part(path)], sampling=sampling)
    (batch,) = prepared.batches
    pv = batch.tensors["pixel_values"]
    assert list(pv.shape) == row["pixel_values_videos_shape"]
    assert len(prepared.input_ids) == row["input_ids_len"]
    assert prepared.input_ids.count(batch.placeholder_token_id) == row["num_video_tokens"]
    assert sha256_ids(list(prepared.input_ids)) == row["input_ids_sha256"]
    assert sha256_f32le(pv) == row["pixel_values_videos_sha256"], f"pixels differ {note}"
