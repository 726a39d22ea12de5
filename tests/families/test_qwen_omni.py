"""Qwen2.5-Omni and Qwen3-Omni through the gateway's pipeline against the transformers 5.24 processors.

One chat request with one image and two audio clips (``input_audio`` wav parts, one at 16 kHz, one at
44.1 kHz stereo, so the decoder resamples and downmixes) goes through ``Pipeline.prepare``.  The
reference is the model's own processor (``AutoProcessor``: ``Qwen2_5OmniProcessor`` /
``Qwen3OmniMoeProcessor``) on the same waveforms (what mmgate's decoder produced; decode parity is
tests/audio's) and the same image:

* ``input_ids`` of ``processor(text=apply_chat_template(tokenize=False), images=[image], audio=clips)``
  are the pipeline's ids exactly (pad runs included);
* ``pixel_values`` and ``image_grid_thw`` are identical;
* per clip, ``input_features`` (its valid frames) and the mask's sum are identical to the processor's one
  call on the request's clips (it pads the shorter clip to the longer one, and so does mmgate: docs/parity.md
  "Several clips in one request"), and the batch's ``feature_attention_mask`` equals the batched
  processor's mask (Qwen3-Omni; Qwen2.5-Omni's is over 30000 padded frames, compared on the valid ones);
* the placeholder range of each clip is its pad run.

Plus the refusals the family owns (a non-bool ``use_audio_in_video``, unknown options) and its item limits.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.config.settings import Settings
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.fetch import MediaFetcher
from mmgate.models.backend import ImageBackend
from mmgate.models.bundle import load_bundle
from mmgate.models.registry import load_family
from mmgate.pipeline.cache import PixelCache
from mmgate.pipeline.prepare import Pipeline
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.request.parse import parse_chat_request
from mmgate.types import Modality
from tests.audio.clips import encode
from tests.conftest import bundle_dir

QWEN2_5_OMNI = "Qwen--Qwen2.5-Omni-7B"
QWEN3_OMNI = "Qwen--Qwen3-Omni-30B-A3B-Instruct"
BUNDLES = (QWEN2_5_OMNI, QWEN3_OMNI)


def tone(seconds: float, rate: int, channels: int, seed: int) -> np.ndarray:
    """float32 ``[channels, n]``: a tone plus noise."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * rate))
    t = np.arange(n) / rate
    sig = 0.3 * np.sin(2 * np.pi * (200 + 90 * seed) * t)[None, :] + 0.05 * rng.standard_normal((channels, n))
    return np.clip(sig, -0.9, 0.9).astype(np.float32)


#: a 16 kHz mono clip of 1.3 s plus 37 samples (not a hop multiple) and a 44.1 kHz stereo clip of 0.77 s
CLIP_BYTES = (encode(tone(1.3 + 37 / 16000, 16000, 1, 1), "wav", 16000), encode(tone(0.77, 44100, 2, 2), "wav", 44100))


def image_png(width: int = 97, height: int = 61) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(7).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def audio_part(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def chat_body(model: str, image: bytes, clips: tuple[bytes, ...], **extra: object) -> dict:
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}},
               audio_part(clips[0]), {"type": "text", "text": "What do you hear and see?"}, audio_part(clips[1])]
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


@cache
def runtime(folder: str) -> ModelRuntime:
    bundle = load_bundle(bundle_dir(folder))
    tokenizer = load_tokenizer(bundle)
    family = load_family(bundle, tokenizer, ImageBackend.TORCHVISION)
    return ModelRuntime(bundle=bundle, tokenizer=tokenizer, family=family, served_name=folder)


def prepare(folder: str, body: dict):
    settings = Settings(model=folder, image_backend=ImageBackend.TORCHVISION)
    with ThreadPoolExecutor(2) as pool:
        pipe = Pipeline(runtime(folder), settings, MediaFetcher(settings.fetch), pool, PixelCache(64 << 20))
        return asyncio.run(pipe.prepare(parse_chat_request(json.dumps(body).encode())))


@cache
def reference(folder: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(bundle_dir(folder)))


def decoded_clips(folder: str) -> list[np.ndarray]:
    """The waveforms the gateway's decoder gives (mono float32 at 16 kHz), fed to the reference too."""
    from mmgate.media.audio import decode_audio

    return [decode_audio(b, 16000, max_input_bytes=1 << 30, max_duration_s=600.0, timeout_s=30.0).samples
            for b in CLIP_BYTES]


@pytest.mark.parametrize("folder", BUNDLES, ids=lambda f: f.split("--")[1])
def test_image_and_two_clips_match_the_processor(folder: str) -> None:
    from PIL import Image

    png = image_png()
    prepared = prepare(folder, chat_body(folder, png, CLIP_BYTES))
    proc = reference(folder)
    clips = decoded_clips(folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                             {"type": "text", "text": "What do you hear and see?"},
                                             {"type": "audio"}]}]
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    ref = proc(text=text, images=[image], audio=clips, return_tensors="np")
    assert list(prepared.input_ids) == ref["input_ids"][0].tolist()

    batches = {b.modality: b for b in prepared.batches}
    img = batches[Modality.IMAGE]
    assert np.array_equal(img.tensors["pixel_values"], ref["pixel_values"])
    assert np.array_equal(img.tensors["image_grid_thw"], ref["image_grid_thw"])

    audio = batches[Modality.AUDIO]
    feats = audio.tensors["input_features"]
    mask = audio.tensors["feature_attention_mask"]
    lengths = audio.tensors["audio_feature_lengths"]
    assert feats.dtype == np.float32 and mask.dtype == np.int64 and lengths.dtype == np.int64
    ref_lengths = ref["feature_attention_mask"].sum(-1)
    assert lengths.tolist() == ref_lengths.tolist()
    assert feats.shape == (2, 128, int(ref_lengths.max()))
    assert np.array_equal(mask, ref["feature_attention_mask"][:, :mask.shape[1]])
    assert not ref["feature_attention_mask"][:, mask.shape[1]:].any()
    for k in range(len(clips)):  # the processor's one call pads the shorter clip to the longer (batch padding)
        valid = int(lengths[k])
        assert np.array_equal(feats[k, :, :valid], ref["input_features"][k][:, :valid]), f"clip {k}"
        assert not feats[k, :, valid:].any()  # batch padding: zeros, masked out

    # each clip's placeholder range is its pad run, in prompt order
    token = proc.audio_token_id
    ids = list(prepared.input_ids)
    starts = [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]
    counts = [sum(1 for _ in iter_run(ids, s, token)) for s in starts]
    assert [(p.offset, p.length) for p in audio.placeholders] == list(zip(starts, counts))
    assert audio.placeholder_token_id == token


def iter_run(ids: list[int], start: int, token: int):
    i = start
    while i < len(ids) and ids[i] == token:
        yield i
        i += 1


@pytest.mark.parametrize("folder", BUNDLES, ids=lambda f: f.split("--")[1])
def test_use_audio_in_video_must_be_a_bool_and_unknown_options_are_refused(folder: str) -> None:
    png = image_png()
    for bad in ("yes", 1):
        with pytest.raises(GatewayError) as err:
            prepare(folder, chat_body(folder, png, CLIP_BYTES, mm_processor_kwargs={"use_audio_in_video": bad}))
        assert err.value.code is ErrorCode.INVALID_REQUEST
        assert err.value.param == "mm_processor_kwargs.use_audio_in_video"
    with pytest.raises(GatewayError) as err:
        prepare(folder, chat_body(folder, png, CLIP_BYTES, mm_processor_kwargs={"fps": 2}))
    assert err.value.code is ErrorCode.INVALID_REQUEST and err.value.param == "mm_processor_kwargs.fps"
    # false is the reference's default (and what smg sends); true without a video changes nothing (the
    # processor loads tracks of videos only): clips with a track are tests/families/test_omni_audio_in_video.py's
    plain = prepare(folder, chat_body(folder, png, CLIP_BYTES))
    for value in (False, True):
        ok = prepare(folder, chat_body(folder, png, CLIP_BYTES, mm_processor_kwargs={"use_audio_in_video": value}))
        assert {b.modality for b in ok.batches} == {Modality.IMAGE, Modality.AUDIO}
        assert ok.input_ids == plain.input_ids


@pytest.mark.parametrize("folder", BUNDLES, ids=lambda f: f.split("--")[1])
def test_limits_are_smg_s(folder: str) -> None:
    """smg ``registry/qwen3_omni.rs`` ``modality_limits`` (used for Qwen2.5-Omni too); video parity is
    tests/video/test_omni_video.py's."""
    assert dict(runtime(folder).family.limits) == {Modality.IMAGE: 10, Modality.VIDEO: 1, Modality.AUDIO: 10}
