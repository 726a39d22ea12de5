"""Tier (a) for InternVL3 video: the ``clips`` of ``golden/internvl.json`` replayed without transformers.

Per clip (1, 2, 7, 33, 301 frames, remade with ``tests/video/video_support.make_clip``) and frame
sampling rule: every frame mmgate decodes (``decode_video``) has the RGB bytes transformers' pyav
loader decoded (else the encoder or decoder changed, not mmgate); the family keeps the recorded
frames (``sample``); through the pipeline (``video_support.prepare``, template + tokenizer + family)
the ids and the clip's ``pixel_values`` have the recorded sha256, or the request is refused where the
recorded expansion passes the context.  mmgate's ids carry vLLM's ``<video>`` where transformers has
``<IMG_CONTEXT>`` inside a clip (``mmgate.models.internvl_video``): each ``<video>`` is read back as
``<IMG_CONTEXT>`` (both ids from the fixture's bundle entry) before hashing, as
``tests/video/test_internvl_video.py`` does.  The fixture is written by
``scripts/gen_golden.py --family internvl`` (builder ``scripts/golden_internvl.py``).
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

MODEL = "OpenGVLab/InternVL3-1B-hf"
FIXTURE = golden("internvl")
(BUNDLE,) = FIXTURE["bundles"]
VIDEO_ID, CONTEXT_ID = BUNDLE["video_token_id"], BUNDLE["image_token_id"]  # <video> 151674, <IMG_CONTEXT> 151667
ROWS = [pytest.param(r, id=f"{r['clip']['frames']}frames-{r['sampling']}") for r in FIXTURE["clips"]]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("internvl_golden_clips")


def test_the_fixture_has_every_clip_under_both_rules() -> None:
    got = sorted((r["clip"]["frames"], r["sampling"]) for r in FIXTURE["clips"])
    assert got == sorted((n, s) for n in (1, 2, 7, 33, 301) for s in ("vllm", "transformers"))


@pytest.mark.parametrize("row", ROWS)
def test_clip_replays_to_the_recorded_frames_ids_and_pixels(row: dict, clip_dir: Path) -> None:
    from mmgate.media.video import decode_video
    from tests.video.video_support import ClipSpec, make_clip, pipeline, prepare, video_part

    c = row["clip"]
    path = make_clip(ClipSpec(f"ivl_f{c['frames']}", c["frames"], c["fps"], c["width"], c["height"], c["codec"]),
                     clip_dir)
    every = decode_video(path.read_bytes(), lambda meta: list(range(meta.total_frames)), None, 60.0)
    note = versions_note("internvl")
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
    assert batch.placeholder_token_id == VIDEO_ID
    ids = list(prepared.input_ids)
    assert CONTEXT_ID not in ids  # vLLM's wire: the clip's context positions are <video>
    assert ids.count(VIDEO_ID) == row["num_context_tokens"]
    as_reference = [CONTEXT_ID if t == VIDEO_ID else t for t in ids]
    assert len(as_reference) == row["input_ids_len"]
    assert sha256_ids(as_reference) == row["input_ids_sha256"]
    assert batch.tensors["video_num_patches"].tolist() == [len(row["frames_kept"])]
    pv = batch.tensors["pixel_values"]
    assert list(pv.shape) == row["pixel_values_shape"]
    assert sha256_f32le(pv) == row["pixel_values_sha256"], f"pixels differ {note}"
