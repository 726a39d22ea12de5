"""Slow tier: the audio corpus in whole requests with images and a video, through ``Pipeline.prepare``, against the
transformers 5.24 processors (issue 23 acceptance: "``input_ids`` identical to the reference given the same
waveform. Images and video of the same requests exact").

The clips of tests/audio/test_audio_parity_slow.py's corpus (every container/codec, 8-48 kHz, mono and stereo,
0.1-35 s, plus the 301 s one) go, 2-3 per request, into chat requests with one or two generated images (PNG and
JPEG, sizes from 33 to 640 px a side) and, in every third request, one PyAV clip (Omni takes one video); the clips
alternate between ``input_audio`` parts (base64 with their ``format``) and ``audio_url`` ``data:`` URLs, and the
parts' order rotates.  Every clip goes to Qwen3-Omni; every fifth clip of the corpus and the 301 s one to
Qwen2.5-Omni (its processor pads each clip to 300 s, about 0.4 s of CPU a clip: all of them would take the
test past its 60 s budget on 2 cores).

The reference is the model's own processor (``AutoProcessor``) on the whole request:
``processor(text=apply_chat_template(tokenize=False), images=..., videos=..., audio=...)``, given the waveforms
mmgate's decoder produced (decode parity is test_audio_parity_slow.py's), the images as PIL opens them and the
frames transformers' pyav ``load_video`` decodes, sampled as a vLLM worker samples them (``do_sample_frames=True,
fps=2``, as tests/video/test_omni_video.py establishes).  Per request:

* ``input_ids`` identical (every placeholder run included);
* ``pixel_values`` / ``image_grid_thw`` and ``pixel_values_videos`` / ``video_grid_thw`` /
  ``video_second_per_grid`` identical;
* the audio batch: each clip's valid ``input_features`` frames, the mask and the lengths identical to the
  processor's one call on the request's clips (Qwen2.5-Omni pads every clip to 300 s; Qwen3-Omni pads the shorter
  clips to the longest, docs/parity.md "Audio", "Several clips in one request");
* each item's placeholder range is its pad run, in prompt order.
"""

from __future__ import annotations

import base64
import copy
import io
import itertools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmgate.media.audio import decode_audio
from mmgate.types import Modality
from tests.audio.clips import ClipSpec, make_clip
from tests.audio.references import OMNI3, OMNI25
from tests.audio.test_audio_parity_slow import corpus
from tests.video import video_support
from tests.video.video_support import load, prepare, processor, vllm_video_kwargs

pytestmark = pytest.mark.slow

#: ``input_audio.format`` and ``data:`` media type of each corpus codec
FORMATS = {"wav": ("wav", "audio/wav"), "flac": ("flac", "audio/flac"), "mp3": ("mp3", "audio/mpeg"),
           "ogg_opus": ("ogg", "audio/ogg"), "m4a_aac": ("m4a", "audio/mp4"), "webm_opus": ("webm", "audio/webm")}
#: image (height, width, format), cycled
IMAGES = ((61, 97, "PNG"), (224, 224, "JPEG"), (300, 170, "PNG"), (33, 517, "JPEG"), (480, 640, "PNG"),
          (128, 45, "JPEG"), (250, 400, "JPEG"), (90, 130, "PNG"))
#: the requests' video clips, cycled (name, frames, fps, width, height; mpeg4 and variable frame durations too)
VIDEOS = (video_support.ClipSpec("mix_f9_10fps", 9, 10, 64, 48),
          video_support.ClipSpec("mix_f17_25fps_mpeg4", 17, 25, 70, 46, codec="mpeg4"),
          video_support.ClipSpec("mix_f20_vfr", 20, 30, 63, 45, durations_ms=(33, 33, 100, 17, 250, 40, 66, 10)),
          video_support.ClipSpec("mix_f6_4fps_big", 6, 4, 320, 240))
MODELS = {OMNI25: "Qwen/Qwen2.5-Omni-7B", OMNI3: "Qwen/Qwen3-Omni-30B-A3B-Instruct"}
TEXTS = ("Describe all of it.", "What do you hear?", "Compare the sounds with the pictures.")


@dataclass(frozen=True)
class Request:
    clips: tuple[ClipSpec, ...]
    images: tuple[tuple[int, int, str], ...]
    video: video_support.ClipSpec | None
    rotate: int  # the parts' order: audio, image, video parts rotated by this much
    text: str


def requests(specs: list[ClipSpec]) -> list[Request]:
    """``specs`` cut into requests of 3, 2, 3, 2, ... clips (a last single clip joins the one before)."""
    groups: list[list[ClipSpec]] = []
    sizes = itertools.cycle((3, 2))
    i = 0
    while i < len(specs):
        n = next(sizes)
        groups.append(list(specs[i:i + n]))
        i += n
    if len(groups) > 1 and len(groups[-1]) == 1:
        groups[-2].extend(groups.pop())
    images, videos = itertools.cycle(IMAGES), itertools.cycle(VIDEOS)
    return [Request(tuple(g), tuple(next(images) for _ in range(1 + k % 2)), next(videos) if k % 3 == 0 else None,
                    k, TEXTS[k % len(TEXTS)]) for k, g in enumerate(groups)]


def image_bytes(h: int, w: int, fmt: str) -> bytes:
    pixels = np.random.default_rng(h * 1000 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def build(req: Request, clip_bytes: dict[ClipSpec, bytes],
          video_paths: dict[str, Path]) -> tuple[list, list, list[ClipSpec], list[tuple[int, int, str]]]:
    """The chat parts (mmgate) and the chat-template content items (reference), in the same order, and the
    clips and images in prompt order."""
    items: list[tuple[dict, dict, Any]] = []
    for k, spec in enumerate(req.clips):
        fmt, mime = FORMATS[spec.codec]
        data = b64(clip_bytes[spec])
        part = ({"type": "input_audio", "input_audio": {"data": data, "format": fmt}} if (req.rotate + k) % 2 == 0
                else {"type": "audio_url", "audio_url": {"url": f"data:{mime};base64,{data}"}})
        items.append((part, {"type": "audio"}, spec))
    for h, w, fmt in req.images:
        url = f"data:image/{fmt.lower()};base64,{b64(image_bytes(h, w, fmt))}"
        items.append(({"type": "image_url", "image_url": {"url": url}}, {"type": "image"}, (h, w, fmt)))
    if req.video is not None:
        items.append((video_support.video_part(video_paths[req.video.name]), {"type": "video"}, None))
    r = req.rotate % len(items)
    items = items[r:] + items[:r]
    return ([p for p, _, _ in items], [c for _, c, _ in items],
            [x for _, c, x in items if c["type"] == "audio"], [x for _, c, x in items if c["type"] == "image"])


def runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of every run of ``token`` in ``ids``."""
    out = []
    i = 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            out.append((i, j - i))
            i = j
        else:
            i += 1
    return out


def check(folder: str, req: Request, clip_bytes: dict[ClipSpec, bytes], video_paths: dict[str, Path]) -> None:
    model = MODELS[folder]
    parts, content, audio_order, image_order = build(req, clip_bytes, video_paths)
    prepared = prepare(model, parts, text=req.text)
    proc = processor(model)
    where = f"{folder} clips={[s.id for s in req.clips]} images={req.images} video={req.video and req.video.name}"

    images = [Image.open(io.BytesIO(image_bytes(h, w, fmt))).convert("RGB") for h, w, fmt in image_order]
    waves = [decode_audio(clip_bytes[s], 16000, max_input_bytes=1 << 30, max_duration_s=600.0, timeout_s=60.0).samples
             for s in audio_order]

    messages = [{"role": "user", "content": [*content, {"type": "text", "text": req.text}]}]
    prompt = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    kwargs: dict[str, Any] = {"images_kwargs": {}}
    if req.video is not None:
        frames, meta = load(video_paths[req.video.name])
        kwargs.update(videos=[frames], video_metadata=[copy.deepcopy(meta)],
                      videos_kwargs={"cap_pixels_per_frame": False, **vllm_video_kwargs(model)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = proc(text=[prompt], images=images, audio=waves, return_tensors="np", **kwargs)

    ids = list(prepared.input_ids)
    ref_ids = [int(t) for t in ref["input_ids"][0]]
    if ids != ref_ids:
        first = next((i for i, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), min(len(ids), len(ref_ids)))
        raise AssertionError(f"{where}: input_ids differ at {first} (mmgate {ids[first:first + 8]}, "
                             f"reference {ref_ids[first:first + 8]}; lengths {len(ids)} / {len(ref_ids)})")

    batches = {b.modality: b for b in prepared.batches}
    assert set(batches) == {Modality.AUDIO, Modality.IMAGE} | ({Modality.VIDEO} if req.video else set()), where

    img = batches[Modality.IMAGE]
    assert np.array_equal(img.tensors["pixel_values"], ref["pixel_values"]), where
    assert np.array_equal(img.tensors["image_grid_thw"], ref["image_grid_thw"]), where
    assert [(p.offset, p.length) for p in img.placeholders] == runs(ids, proc.image_token_id), where

    if req.video is not None:
        vid = batches[Modality.VIDEO]
        assert np.array_equal(vid.tensors["pixel_values"], ref["pixel_values_videos"]), where
        assert np.array_equal(vid.tensors["video_grid_thw"], ref["video_grid_thw"]), where
        assert np.array_equal(vid.tensors["video_second_per_grid"],
                              np.asarray(ref["video_second_per_grid"], dtype=np.float32)), where
        assert [(p.offset, p.length) for p in vid.placeholders] == runs(ids, proc.video_token_id), where

    audio = batches[Modality.AUDIO]
    feats = audio.tensors["input_features"]
    mask = audio.tensors["feature_attention_mask"]
    lengths = audio.tensors["audio_feature_lengths"]
    assert feats.shape == (len(waves), 128, int(lengths.max())), where
    assert mask.tolist() == [[1] * int(n) + [0] * (mask.shape[1] - int(n)) for n in lengths], where
    ref_mask = ref["feature_attention_mask"]
    assert lengths.tolist() == ref_mask.sum(-1).tolist(), f"{where}: lengths {lengths.tolist()}"
    assert np.array_equal(mask, ref_mask[:, :mask.shape[1]]) and not ref_mask[:, mask.shape[1]:].any(), where
    for k in range(len(waves)):
        valid = int(lengths[k])
        assert np.array_equal(feats[k, :, :valid], ref["input_features"][k][:, :valid]), (where, audio_order[k].id)
        assert not feats[k, :, valid:].any(), (where, k)
    assert [(p.offset, p.length) for p in audio.placeholders] == runs(ids, proc.audio_token_id), where
    assert audio.placeholder_token_id == proc.audio_token_id


def plan() -> dict[str, list[Request]]:
    specs = corpus()
    longest = max(specs, key=lambda s: s.seconds)
    omni25 = specs[::5] + ([longest] if longest not in specs[::5] else [])
    return {OMNI3: requests(specs), OMNI25: requests(omni25)}


def test_the_plan_covers_the_corpus_and_the_request_shapes() -> None:
    p = plan()
    every = corpus()
    assert sorted(s.id for r in p[OMNI3] for s in r.clips) == sorted(s.id for s in every)
    assert {s.codec for r in p[OMNI25] for s in r.clips} == set(FORMATS)
    assert max(s.seconds for r in p[OMNI25] for s in r.clips) > 300
    for reqs in p.values():
        assert all(2 <= len(r.clips) <= 3 and 1 <= len(r.images) <= 2 for r in reqs)
        assert any(r.video for r in reqs) and any(r.video is None for r in reqs)
        assert {len(r.images) for r in reqs} == {1, 2}


@pytest.mark.parametrize("folder", (OMNI3, OMNI25), ids=lambda f: f.split("--")[1])
def test_mixed_requests_equal_the_processor(folder: str, tmp_path: Path) -> None:
    reqs = plan()[folder]
    clip_bytes = {s: make_clip(s) for r in reqs for s in r.clips}
    video_paths = {v.name: video_support.make_clip(v, tmp_path) for v in VIDEOS}
    for req in reqs:
        check(folder, req, clip_bytes, video_paths)
