"""Qwen3-ASR through the chat pipeline equals its transformers 5.24 processor.

A chat request with ``input_audio`` parts (16-bit PCM WAV at 16 kHz, so the waveform every loader gives is
``int16 / 32768``) goes through :meth:`mmgate.pipeline.prepare.Pipeline.prepare`; the reference is
``Qwen3ASRProcessor.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)`` with the
same waveforms (the ids), and the processor run on each clip alone (the features: mmgate processes every
clip alone, docs/parity.md "Audio"): ``input_ids`` identical, each clip's ``input_features`` valid frames
identical, the mask and lengths equal ``input_features_mask`` and its sum.  Also the transcription prompt
(:func:`mmgate.models.qwen3_asr.transcription_messages` rendered with ``continue_final_message``) against
``apply_transcription_request``, and the language table.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

import numpy as np
import pytest

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.config.settings import Settings
from mmgate.errors import GatewayError
from mmgate.media.fetch import MediaFetcher
from mmgate.models.bundle import load_bundle
from mmgate.models.qwen3_asr import resolve_language, strip_language_prefix
from mmgate.models.registry import load_family
from mmgate.models.backend import ImageBackend
from mmgate.pipeline.cache import PixelCache
from mmgate.pipeline.prepare import Pipeline
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.request.parse import parse_chat_request
from mmgate.types import Modality, PreparedRequest
from tests.audio.clips import pcm16_tone, wav16
from tests.conftest import bundle_dir

ASR = "Qwen--Qwen3-ASR-0.6B"
SR = 16_000


def pcm16(samples: int, seed: int) -> np.ndarray:
    """A tone plus noise as int16 (tests/audio/clips.py)."""
    return pcm16_tone(samples, seed, 200, 150, SR)


def wav_bytes(pcm: np.ndarray) -> bytes:
    return wav16(pcm, SR)


def as_float(pcm: np.ndarray) -> np.ndarray:
    return (pcm.astype(np.float32) / np.float32(32768.0)).astype(np.float32)


def audio_part(pcm: np.ndarray) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(pcm)).decode(), "format": "wav"}}


@cache
def processor() -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(bundle_dir(ASR)))


def prepare(body: dict[str, Any]) -> PreparedRequest:
    bundle = load_bundle(bundle_dir(ASR))
    tokenizer = load_tokenizer(bundle)
    family = load_family(bundle, tokenizer, ImageBackend.PIL)
    runtime = ModelRuntime(bundle=bundle, tokenizer=tokenizer, family=family, served_name="asr")
    settings = Settings(model="asr")
    with ThreadPoolExecutor(2) as pool:
        pipe = Pipeline(runtime, settings, MediaFetcher(settings.fetch), pool, PixelCache(64 << 20))
        return asyncio.run(pipe.prepare(parse_chat_request(json.dumps(body).encode())))


#: 0.3 s (under min_length: zero-padded to 8000 samples, 50 frames), 2.0023 s (not a multiple of the hop),
#: 3.7 s + 77 (past one 100-frame chunk)
CLIPS = (pcm16(4800, 1), pcm16(2 * SR + 37, 2), pcm16(59277, 3))


def reference_ids(conversation: list[dict[str, Any]], waves: list[np.ndarray]) -> list[int]:
    """The processor's ids for a conversation with several clips: ``Qwen3ASRProcessor`` takes one clip per text
    (``validate_inputs``: "they must match 1:1"), so the rendered template's ``<|audio_pad|>`` anchors are each
    replaced by the run the processor gives that clip alone (``processor(text=[pad], audio=[clip])``: what its
    ``_process_audio`` / ``replace_audio_token`` do), then tokenized as its ``__call__`` tokenizes."""
    proc = processor()
    text = proc.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    pieces = text.split(proc.audio_token)
    assert len(pieces) == len(waves) + 1
    out = pieces[0]
    for w, piece in zip(waves, pieces[1:]):
        alone = proc(text=[proc.audio_token], audio=[w], sampling_rate=SR)
        out += proc.audio_token * int((alone["input_ids"][0] == proc.audio_token_id).sum()) + piece
    return proc.tokenizer(out)["input_ids"]


def test_chat_with_one_clip_equals_apply_chat_template() -> None:
    body = {"model": "asr", "messages": [
        {"role": "user", "content": [audio_part(CLIPS[2]), {"type": "text", "text": "What is said?"}]}]}
    prepared = prepare(body)
    wave_ = as_float(CLIPS[2])
    conversation = [{"role": "user", "content": [{"type": "audio", "audio": wave_},
                                                 {"type": "text", "text": "What is said?"}]}]
    ref = processor().apply_chat_template(conversation, tokenize=True, add_generation_prompt=True, return_dict=True,
                                          processor_kwargs={"sampling_rate": SR})
    assert list(prepared.input_ids) == ref["input_ids"][0].tolist()
    (batch,) = prepared.batches
    valid = int(ref["input_features_mask"][0].sum())
    assert batch.tensors["audio_feature_lengths"].tolist() == [valid]
    np.testing.assert_array_equal(batch.tensors["input_features"][0], ref["input_features"][0].numpy()[:, :valid])
    assert batch.tensors["feature_attention_mask"][0].tolist() == ref["input_features_mask"][0, :valid].tolist()


def test_chat_with_three_clips_equals_the_processor_per_clip() -> None:
    body = {"model": "asr", "messages": [
        {"role": "system", "content": "Transcribe carefully."},
        {"role": "user", "content": [audio_part(CLIPS[0]), {"type": "text", "text": "What is said?"},
                                     audio_part(CLIPS[1]), audio_part(CLIPS[2])]}]}
    prepared = prepare(body)

    proc = processor()
    waves = [as_float(c) for c in CLIPS]
    conversation = [{"role": "system", "content": [{"type": "text", "text": "Transcribe carefully."}]},
                    {"role": "user", "content": [{"type": "audio", "audio": waves[0]},
                                                 {"type": "text", "text": "What is said?"},
                                                 {"type": "audio", "audio": waves[1]},
                                                 {"type": "audio", "audio": waves[2]}]}]
    assert list(prepared.input_ids) == reference_ids(conversation, waves)

    (batch,) = prepared.batches
    assert batch.modality is Modality.AUDIO and batch.placeholder_token_id == 151676 == proc.audio_token_id
    features = batch.tensors["input_features"]
    mask = batch.tensors["feature_attention_mask"]
    lengths = batch.tensors["audio_feature_lengths"]
    assert features.dtype == np.float32 and mask.dtype == np.int64 and lengths.dtype == np.int64
    assert features.shape[0] == mask.shape[0] == lengths.shape[0] == 3
    for k, w in enumerate(waves):
        alone = proc(text=[proc.audio_token], audio=[w], sampling_rate=SR)
        ref_mask = alone["input_features_mask"][0].numpy()
        valid = int(ref_mask.sum())
        assert int(lengths[k]) == valid
        assert mask[k, :valid].tolist() == ref_mask[:valid].tolist() and not mask[k, valid:].any()
        np.testing.assert_array_equal(features[k, :, :valid], alone["input_features"][0].numpy()[:, :valid])
        assert not features[k, :, valid:].any()
    # clip 0: 4800 samples zero-padded to 8000 -> 50 valid frames (the processor's min_length)
    assert int(lengths[0]) == 50
    # each clip's run of <|audio_pad|> is its own placeholder range, in prompt order
    ids = list(prepared.input_ids)
    starts = [i for i, t in enumerate(ids) if t == 151676 and (i == 0 or ids[i - 1] != 151676)]
    assert [(p.offset, p.length) for p in batch.placeholders] == [
        (s, int(n)) for s, n in zip(starts, [p.num_tokens for p in prepared.plans])]


@pytest.mark.parametrize(("language", "prompt"), [(None, None), ("en", None), ("Chinese", "hot words: Qwen")])
def test_transcription_prompt_equals_apply_transcription_request(language: str | None, prompt: str | None) -> None:
    from mmgate.models.qwen3_asr import transcription_messages

    clip = CLIPS[1]
    messages = transcription_messages(audio_part(clip), language, prompt)
    prepared = prepare({"model": "asr", "messages": messages, "add_generation_prompt": False,
                        "continue_final_message": True})
    ref = processor().apply_transcription_request(as_float(clip), language=language, prompt=prompt,
                                                  processor_kwargs={"sampling_rate": SR})
    assert list(prepared.input_ids) == ref["input_ids"][0].tolist()
    (batch,) = prepared.batches
    valid = int(ref["input_features_mask"][0].sum())
    np.testing.assert_array_equal(batch.tensors["input_features"][0], ref["input_features"][0].numpy()[:, :valid])


def test_languages_resolve_as_transformers_does() -> None:
    from transformers.audio_utils import resolve_language as reference
    from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME

    for code, name in LANGUAGE_CODE_TO_NAME.items():
        for given in (code, name, code.upper(), name.lower()):
            assert resolve_language(given) == reference(given, LANGUAGE_CODE_TO_NAME, return_code=False)
    with pytest.raises(GatewayError) as err:
        resolve_language("klingon")
    assert err.value.status == 400 and err.value.param == "language"


def test_language_prefix_is_stripped_as_the_processor_parses_it() -> None:
    proc = processor()
    for raw in ("language English<asr_text>Hello there.", "Hello there.", "language None<asr_text>",
                " language Chinese<asr_text> 你好 "):
        assert strip_language_prefix(raw) == proc.extract_transcription(raw)


def test_continue_final_message_with_add_generation_prompt_is_refused_as_vllm_does() -> None:
    body = {"model": "asr", "continue_final_message": True,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "language"}]}
    with pytest.raises(GatewayError) as err:
        parse_chat_request(json.dumps(body).encode())  # add_generation_prompt defaults to true
    assert err.value.status == 400 and err.value.param == "continue_final_message"
