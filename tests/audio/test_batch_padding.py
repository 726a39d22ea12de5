"""Several clips in one request: the processor's one feature-extractor call pads the shorter clips to the longest.

transformers 5.24 ``Qwen3OmniMoeProcessor`` calls its extractor once on every audio item of the request with
``padding=True`` (longest): a shorter clip is zero-padded to the longest, so its end frames
see zeros (not the reflection ``torch.stft(center=True)`` gives a clip alone) and the mask gives it ``ceil(n / hop)``
frames (``floor(n / hop)`` alone).  (``Qwen3ASRProcessor`` takes one clip per text: never a batch.)  Expected values: the processors themselves, on the same waveforms in one call.
``--no-audio-batch-padding`` (``AudioSettings.batch_padding=False``) gives each clip its features alone: checked
against the processor on each clip alone.
"""

from __future__ import annotations

import asyncio
import base64
import io
import warnings
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmgate.config.settings import AudioSettings
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.audio_features import (
    log_mel_features,
    longest_in_batch,
    qwen2_5_omni_audio_tokens,
    qwen3_omni_audio_tokens,
)
from mmgate.pipeline.cache import PixelCache
from mmgate.types import Modality, PreparedRequest
from tests.audio.clips import pcm16_tone, wav16
from tests.audio.references import ASR, OMNI3, OMNI25, Processors, mel_params
from tests.video.video_support import chat_body, pipeline, prepare, processor

#: samples at 16 kHz: 16 hops + 50 (one frame more batched), the longest (1 s), 7999,
#: 10 short of the longest (its end frames reach the longest's own reflection), a hop multiple, and 150 samples
#: (too short for Qwen3-Omni's STFT alone, framed once padded to the longest)
LENGTHS = (2610, 16000, 7999, 15990, 8000, 150)
TOKENS = {OMNI25: qwen2_5_omni_audio_tokens, OMNI3: qwen3_omni_audio_tokens}


def waveform(n: int, seed: int) -> np.ndarray:
    """Noise plus a tone that grows to the end (the loudest frames, the clamp's max, are the last ones)."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return (0.2 * rng.standard_normal(n) + 0.6 * np.sin(0.07 * t) * (t / n)).astype(np.float32)


def runs(ids: list[int], token: int) -> list[int]:
    """Lengths of the runs of ``token`` in ``ids``, in order."""
    out: list[int] = []
    prev = None
    for t in ids:
        if t == token:
            if prev != token:
                out.append(0)
            out[-1] += 1
        prev = t
    return out


def batched_reference(processors: Processors, name: str, waves: list[np.ndarray]) -> dict[str, Any]:
    """The processor on one text with one audio anchor per clip and every clip in one call."""
    proc = processors.get(name)
    text = (proc.audio_bos_token + proc.audio_token + proc.audio_eos_token) * len(waves)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = proc(text=[text], audio=waves, return_tensors="np")
    mask = out["feature_attention_mask"]
    audio_id = proc.tokenizer.convert_tokens_to_ids(proc.audio_token)
    return {"features": out["input_features"], "mask": mask,
            "runs": runs([int(t) for t in out["input_ids"][0]], audio_id)}


def test_qwen3_asr_takes_one_clip_per_text_so_its_clips_are_never_one_batch(processors: Processors) -> None:
    """Qwen3-ASR is no :class:`BatchPlanner`: its processor refuses several clips for one text."""
    proc = processors.get(ASR)
    text = (proc.audio_bos_token + proc.audio_token + proc.audio_eos_token) * 2
    with pytest.raises(ValueError, match="1:1"):
        proc(text=[text], audio=[waveform(8000, 0), waveform(16000, 1)], return_tensors="pt")
    from mmgate.models.family import BatchPlanner
    from tests.video.video_support import pipeline as make_pipeline

    family = make_pipeline(ASR).runtime.family
    assert family is not None and not isinstance(family.processors[Modality.AUDIO], BatchPlanner)
    assert isinstance(make_pipeline(OMNI3).runtime.family.processors[Modality.AUDIO], BatchPlanner)  # type: ignore[union-attr]


@pytest.mark.parametrize("name", (OMNI3, OMNI25))
def test_each_clip_s_features_in_a_batch_equal_the_processor_s_one_call(processors: Processors, name: str) -> None:
    lengths = LENGTHS if name != OMNI25 else LENGTHS[:3]  # Qwen2.5-Omni pads each clip to 30 s: batch-free
    waves = [waveform(n, k) for k, n in enumerate(lengths)]
    ref = batched_reference(processors, name, waves)
    params = mel_params(name, processors)
    longest = longest_in_batch(params, lengths)
    for k, wave in enumerate(waves):
        valid = int(ref["mask"][k].sum())
        got = log_mel_features(wave, params, backend="torch", batch_longest=longest)
        assert got.valid_frames == valid, (k, lengths[k])
        assert params.valid_frames(lengths[k], longest) == valid
        np.testing.assert_array_equal(got.input_features, ref["features"][k][:, :valid], err_msg=f"clip {k}")
        assert TOKENS[name](valid) == ref["runs"][k]
    if name == OMNI3:  # the batch gives 2610 samples 17 frames (16 alone) and frames 150 samples at all
        assert [int(m.sum()) for m in ref["mask"]] == [17, 100, 50, 100, 50, 1]
        assert params.valid_frames(2610) == 16 and params.too_short(150) and not params.too_short(150, longest)


def test_a_batch_that_changes_nothing_keys_as_the_clip_alone(processors: Processors) -> None:
    """``batch_key``: 0 for the longest clip and for every Qwen2.5-Omni clip; otherwise the framed buffer, the same
    for every batch whose longest clip is at least ``n_fft + hop`` samples longer."""
    omni3, omni25 = mel_params(OMNI3, processors), mel_params(OMNI25, processors)
    assert omni3.batch_key(16000, 16000) == 0 and omni3.batch_key(16000, 0) == 0
    assert omni25.batch_key(2610, 16000) == 0
    assert omni3.batch_key(2610, 16000) == omni3.batch_key(2610, 48000) == 5120  # at least 32 frames
    assert omni3.batch_key(15990, 16000) == 16000
    assert omni3.batch_key(15990, 16000) != omni3.batch_key(15990, 32000)
    wave = waveform(2610, 3)
    np.testing.assert_array_equal(log_mel_features(wave, omni3, batch_longest=16000).input_features,
                                  log_mel_features(wave, omni3, batch_longest=48000).input_features)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (61, 97, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _parts(*clips: bytes, image: bytes | None = None) -> list[dict]:
    parts = [{"type": "input_audio", "input_audio": {"data": _b64(c), "format": "wav"}} for c in clips]
    if image is not None:
        parts.insert(1, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(image)}})
    return parts


def _audio(prepared: PreparedRequest) -> Any:
    return next(b for b in prepared.batches if b.modality is Modality.AUDIO)


SHORT = wav16(pcm16_tone(16 * 160 + 50, 1, 300.0, 50.0))  # 2610 samples
LONG = wav16(pcm16_tone(16000, 2, 300.0, 50.0))


def _reference_request(model: str, clips: list[bytes], png: bytes) -> dict[str, Any]:
    """The processor on the whole request (chat template, the image, every clip in one call)."""
    from mmgate.media.audio import decode_audio

    proc = processor(model)
    waves = [decode_audio(c, 16000, max_input_bytes=1 << 20, max_duration_s=60.0, timeout_s=60.0).samples
             for c in clips]
    content = [{"type": "audio"}, {"type": "image"}] + [{"type": "audio"}] * (len(clips) - 1)
    prompt = proc.apply_chat_template([{"role": "user", "content": [*content, {"type": "text", "text": "Hi"}]}],
                                      add_generation_prompt=True, tokenize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dict(proc(text=[prompt], images=[Image.open(io.BytesIO(png)).convert("RGB")], audio=waves,
                         return_tensors="np"))


def test_qwen3_omni_request_equals_the_processor_on_the_whole_request() -> None:
    """A 2610-sample clip, an image and a 1 s clip: the processor's batch masks the short clip to 17 frames (3
    audio tokens; 16 frames and 2 tokens alone), and so does mmgate: ids, features, mask and lengths."""
    model, png = OMNI3, _png()
    prepared = prepare(model, _parts(SHORT, LONG, image=png), text="Hi")
    ref = _reference_request(model, [SHORT, LONG], png)
    assert ref["feature_attention_mask"].sum(-1).tolist() == [17, 100]
    assert list(prepared.input_ids) == [int(t) for t in ref["input_ids"][0]]
    audio = _audio(prepared)
    assert audio.tensors["audio_feature_lengths"].tolist() == [17, 100]
    for k, valid in enumerate((17, 100)):
        assert np.array_equal(audio.tensors["input_features"][k, :, :valid], ref["input_features"][k][:, :valid])
    assert audio.tensors["feature_attention_mask"].tolist() == ref["feature_attention_mask"][:, :100].tolist()


def test_without_batch_padding_each_clip_is_the_processor_s_clip_alone() -> None:
    """``--no-audio-batch-padding``: the short clip's 16 frames and 2 tokens, its features those of the processor
    on it alone (the end frames see its reflection), the long clip's unchanged."""
    model, png = OMNI3, _png()
    prepared = prepare(model, _parts(SHORT, LONG, image=png), text="Hi", audio=AudioSettings(batch_padding=False))
    proc = processor(model)
    from mmgate.media.audio import decode_audio

    audio = _audio(prepared)
    assert audio.tensors["audio_feature_lengths"].tolist() == [16, 100]
    for k, clip in enumerate((SHORT, LONG)):
        wave = decode_audio(clip, 16000, max_input_bytes=1 << 20, max_duration_s=60.0, timeout_s=60.0).samples
        alone = proc(text=proc.audio_bos_token + proc.audio_token + proc.audio_eos_token, audio=[wave],
                     return_tensors="np")
        valid = int(alone["feature_attention_mask"][0].sum())
        assert valid == (16, 100)[k]
        assert np.array_equal(audio.tensors["input_features"][k, :, :valid], alone["input_features"][0][:, :valid])
    assert [p.length for p in audio.placeholders] == [2, 13]


def test_a_batched_clip_hashes_and_caches_apart_from_the_clip_alone() -> None:
    """The short clip's share depends on its batch: its ``mm_hashes`` entry and cache key differ from the clip
    alone, and equal across batches that frame it alike (any longest clip >= n + n_fft + hop samples); the
    longest clip keys as alone."""
    model = OMNI3
    cache = PixelCache(1 << 28)
    pipe = pipeline(model, pixel_cache=cache)
    longer = wav16(pcm16_tone(32000, 3, 440.0, 50.0))

    def run(*clips: bytes) -> Any:
        return _audio(asyncio.run(pipe.prepare(chat_body(model, _parts(*clips), text="Hi"))))

    alone, with_long, with_longer, long_alone = run(SHORT), run(SHORT, LONG), run(SHORT, longer), run(LONG)
    assert alone.mm_hashes[0] != with_long.mm_hashes[0] == with_longer.mm_hashes[0]
    assert with_long.mm_hashes[1] == long_alone.mm_hashes[0]
    assert alone.tensors["audio_feature_lengths"].tolist() == [16]
    assert with_longer.tensors["audio_feature_lengths"].tolist() == [17, 200]
    assert np.array_equal(with_long.tensors["input_features"][0, :, :17],
                          with_longer.tensors["input_features"][0, :, :17])
    # the short clip alone, the short clip batched, the 1 s clip, the 2 s clip
    assert len(cache) == 4


def test_a_clip_too_short_alone_is_framed_in_a_batch_and_refused_alone() -> None:
    """150 samples: Qwen3-Omni's STFT cannot frame it alone (the reference raises, mmgate refuses with
    ``audio_too_short``); padded to a 1 s clip it is one frame, one audio token, in both."""
    model = OMNI3
    tiny = wav16(pcm16_tone(150, 1, 300.0, 50.0))
    with pytest.raises(GatewayError) as info:
        prepare(model, _parts(tiny), text="Hi")
    assert info.value.code is ErrorCode.AUDIO_TOO_SHORT
    png = _png()
    prepared = prepare(model, _parts(tiny, LONG, image=png), text="Hi")
    ref = _reference_request(model, [tiny, LONG], png)
    assert ref["feature_attention_mask"].sum(-1).tolist() == [1, 100]
    assert list(prepared.input_ids) == [int(t) for t in ref["input_ids"][0]]
    audio = _audio(prepared)
    assert np.array_equal(audio.tensors["input_features"][0, :, :1], ref["input_features"][0][:, :1])
