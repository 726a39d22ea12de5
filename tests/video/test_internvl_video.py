"""InternVL3 clips against transformers 5.24 and as vLLM 0.33 reads them (issue 24 items 2, 4, 8).

The reference: ``InternVLProcessor`` on the frames transformers' pyav loader decodes
(``load_video(path, backend="pyav")``), given the frames a vLLM worker keeps (its video loader:
every frame up to 32, else ``np.linspace(0, total - 1, 32, dtype=int)``), or every frame under
``--video-frame-sampling transformers`` (the processor's ``do_sample_frames`` false).  mmgate's
ids carry vLLM's ``<video>`` (151674) where transformers has ``<IMG_CONTEXT>`` (151667) inside a
clip (``interns1.py`` ``_call_hf_processor`` rewrites them): read back with
:func:`mmgate.models.internvl_video.reference_ids` they are the reference's ids; the frames'
``pixel_values`` are the reference's, bit for bit (transformers concatenates them with the images'
in prompt order).  Clips of 1, 2, 7, 33 and 301 frames.  On the vLLM wire (real gateway -> fake
worker -> the installed servicer's ``_build_preprocessed_mm_inputs``): ``pixel_values_videos`` flat
by ``video_num_patches``, ``video_num_patches`` batched, ``video_token_id`` shared, ``is_embed`` on
the ``<video>`` tokens only.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import httpx
import numpy as np
import pytest

from mmgate.config.settings import Settings
from mmgate.models.backend import FrameSampling
from mmgate.models.frame_sampling import vllm_frame_indices
from mmgate.models.internvl_video import reference_ids
from mmgate.types import Modality
from tests.conftest import bundle_dir
from tests.support.fake_worker import FakeWorker, FakeWorkerState
from tests.support.servers import gateway_in_thread
from tests.support.servicer_code import vllm_input
from tests.video.video_support import ClipSpec, data_url, load, make_clip, prepare, processor, video_part

pytest.importorskip("transformers")

MODEL = "OpenGVLab/InternVL3-1B-hf"
VIDEO_ID, CONTEXT_ID, IMG_START, IMG_END = 151674, 151667, 151665, 151666
FRAME_COUNTS = (1, 2, 7, 33, 301)


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("internvl-clips")
    return {n: make_clip(ClipSpec(f"ivl_{n}", n, 25, 66 if n < 100 else 48, 50 if n < 100 else 32), folder)
            for n in FRAME_COUNTS}


@cache
def _loaded(path: Path):  # noqa: ANN202 - transformers' (frames, metadata)
    return load(path)


def _reference(path: Path, indices: list[int] | None, images: list | None = None,
               text: str = "What happens?") -> tuple[list[int], np.ndarray]:
    """``InternVLProcessor`` on the clip's ``indices`` frames (all: None) and ``images`` after it."""
    proc = processor(MODEL)
    frames, _ = _loaded(path)
    given = frames if indices is None else frames[indices]
    content = [{"type": "video"}] + [{"type": "image"} for _ in images or ()] + [{"type": "text", "text": text}]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    out = proc(text=[prompt], videos=[given], images=images, return_tensors="pt")  # "np" fails in 5.24 (flatten)
    return [int(t) for t in out["input_ids"][0]], out["pixel_values"].numpy()


@pytest.mark.parametrize("frames", FRAME_COUNTS)
def test_clip_ids_and_pixels_equal_the_reference_with_vllms_frames(frames: int, clips: dict[int, Path]) -> None:
    prepared = prepare(MODEL, [video_part(clips[frames])])
    kept = vllm_frame_indices(frames)
    assert len(kept) == min(frames, 32)
    want_ids, want_pixels = _reference(clips[frames], kept)
    assert reference_ids(prepared.input_ids, VIDEO_ID, CONTEXT_ID) == want_ids
    (batch,) = prepared.batches
    assert batch.modality is Modality.VIDEO and batch.placeholder_token_id == VIDEO_ID
    assert np.array_equal(batch.tensors["pixel_values"], want_pixels)
    assert batch.tensors["video_num_patches"].tolist() == [len(kept)]
    assert int(batch.tensors["video_token_id"]) == VIDEO_ID
    # vLLM's range: from "Frame1" to the last </img>; 256 <video> per frame, the rest separators
    (r,) = batch.placeholders
    run = prepared.input_ids[r.offset:r.offset + r.length]
    assert run[:5] == (4369, 16, 25, 220, IMG_START)  # "Frame", "1", ":", " ", <img>
    assert run[-1] == IMG_END and run.count(VIDEO_ID) == 256 * len(kept)
    assert CONTEXT_ID not in prepared.input_ids


@pytest.mark.parametrize("frames", (7, 33))
def test_transformers_sampling_keeps_every_frame(frames: int, clips: dict[int, Path]) -> None:
    prepared = prepare(MODEL, [video_part(clips[frames])], sampling=FrameSampling.TRANSFORMERS)
    want_ids, want_pixels = _reference(clips[frames], None)
    assert reference_ids(prepared.input_ids, VIDEO_ID, CONTEXT_ID) == want_ids
    assert np.array_equal(prepared.batches[0].tensors["pixel_values"], want_pixels)
    assert prepared.batches[0].tensors["video_num_patches"].tolist() == [frames]


def test_a_clip_and_an_image_equal_the_reference_and_their_ranges_do_not_overlap(clips: dict[int, Path]) -> None:
    """The text-level clip is located after the token-level image splice (``Pipeline._expand``)."""
    import base64
    import io

    from PIL import Image

    rng = np.random.default_rng(3)
    image = Image.fromarray(rng.integers(0, 256, (400, 900, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    prepared = prepare(MODEL, [video_part(clips[7]), {"type": "image_url", "image_url": {"url": url}}])
    want_ids, want_pixels = _reference(clips[7], vllm_frame_indices(7), images=[Image.open(buf)])
    assert reference_ids(prepared.input_ids, VIDEO_ID, CONTEXT_ID) == want_ids
    by = {b.modality: b for b in prepared.batches}
    video, img = by[Modality.VIDEO], by[Modality.IMAGE]
    # transformers' pixel_values: the clip's frames, then the image's 3 patches (prompt order)
    assert np.array_equal(np.concatenate([video.tensors["pixel_values"], img.tensors["pixel_values"]]), want_pixels)
    (vr,), (ir,) = video.placeholders, img.placeholders
    ids = prepared.input_ids
    assert ids[vr.offset:vr.offset + vr.length].count(VIDEO_ID) == 7 * 256
    assert ids[ir.offset] == IMG_START and ids[ir.offset + ir.length - 1] == IMG_END
    assert ids[ir.offset:ir.offset + ir.length].count(CONTEXT_ID) == 3 * 256
    assert vr.offset + vr.length <= ir.offset


def test_vllm_wire_layout_and_is_embed_of_a_clip(clips: dict[int, Path]) -> None:
    """vLLM ``interns1.py`` ``_get_mm_fields_config`` for video, through the installed servicer."""
    worker = FakeWorker(FakeWorkerState(model_type="internvl"))
    settings = Settings(model=str(bundle_dir(MODEL)), served_model_name=MODEL, worker_urls=(worker.url,))
    try:
        with gateway_in_thread(settings) as base:
            body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": data_url(clips[33])}},
                {"type": "text", "text": "What happens?"}]}]}
            r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
        (got,) = worker.state.received
        vin = vllm_input(got.request)
    finally:
        worker.stop()
    fields = {k: (f.modality, f.kind, f.keep_on_cpu) for k, f in vin.fields.items()}
    assert fields == {"pixel_values_videos": ("video", "flat", False), "video_num_patches": ("video", "batched", False),
                      "video_token_id": ("video", "shared", False)}
    assert vin.fields["pixel_values_videos"].sizes == (32,)
    assert vin.tensors["pixel_values_videos"].shape == (32, 3, 448, 448)
    assert int(vin.tensors["video_token_id"]) == VIDEO_ID
    (ph,) = vin.mm_placeholders["video"]
    assert ph.is_embed is not None and int(ph.is_embed.sum()) == 32 * 256
    ids = np.asarray(vin.prompt_token_ids)
    assert np.array_equal(ph.is_embed.numpy(), ids[ph.offset:ph.offset + ph.length] == VIDEO_ID)
