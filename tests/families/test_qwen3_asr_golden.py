"""Qwen3-ASR's golden replay (``golden/qwen3_asr.json``, written by ``scripts/gen_golden.py --family qwen3_asr``
from transformers 5.24), without transformers: per clip mmgate's plan (valid frames, token count) and the sha256 of
its features (the torch STFT path, bit-exact); per transcription request the ``input_ids`` of
``apply_transcription_request`` through the chat pipeline with ``continue_final_message``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from parity_support import GOLDEN_DIR, find_bundle_dir

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.config.settings import Settings
from mmgate.media.fetch import MediaFetcher
from mmgate.models.backend import ImageBackend
from mmgate.models.bundle import load_bundle
from mmgate.models.qwen3_asr import Qwen3ASRFamily
from mmgate.models.registry import FAMILY_BY_MODEL_TYPE, load_family
from mmgate.pipeline.cache import PixelCache
from mmgate.pipeline.prepare import Pipeline
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.request.parse import parse_chat_request
from mmgate.types import DecodedAudio, ItemHints, Modality

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from golden_qwen3_asr import SR, clip  # noqa: E402

GOLDEN = json.loads((GOLDEN_DIR / "qwen3_asr.json").read_text(encoding="utf-8"))


@cache
def runtime() -> ModelRuntime:
    path = find_bundle_dir(GOLDEN["bundles"][0]["bundle"])
    assert path is not None, "the Qwen3-ASR bundle is on the model path"
    bundle = load_bundle(Path(path))
    tokenizer = load_tokenizer(bundle)
    family = load_family(bundle, tokenizer, ImageBackend.PIL)
    return ModelRuntime(bundle=bundle, tokenizer=tokenizer, family=family, served_name="asr")


def decoded(samples: np.ndarray) -> DecodedAudio:
    return DecodedAudio(samples=samples, sampling_rate=SR, source_rate=SR, source_channels=1, content_hash="x" * 64,
                        num_bytes=samples.nbytes)


def test_the_registry_serves_qwen3_asr_with_audio_only() -> None:
    assert FAMILY_BY_MODEL_TYPE["qwen3_asr"] is Qwen3ASRFamily
    family = runtime().family
    assert family is not None and set(family.processors) == {Modality.AUDIO}
    assert family.limits == {Modality.AUDIO: 10}
    entry = GOLDEN["bundles"][0]
    proc = family.processors[Modality.AUDIO]
    assert proc.anchor_token_id == proc.placeholder_token_id == entry["audio_token_id"]


@pytest.mark.parametrize("row", GOLDEN["rows"], ids=lambda r: r["clip"])
def test_clip_features_and_tokens_equal_the_golden(row: dict[str, Any]) -> None:
    family = runtime().family
    assert family is not None
    proc = family.processors[Modality.AUDIO]
    audio = decoded(clip(row["samples"], row["seed"]))
    plan = proc.plan(audio, ItemHints())  # type: ignore[call-arg, arg-type]
    assert plan.num_tokens == row["num_audio_tokens"]
    assert plan.primary_shape == (128, row["valid_frames"])
    feats = proc.preprocess(audio, plan)  # type: ignore[arg-type]
    assert feats.dtype == np.float32 and feats.shape == plan.primary_shape
    assert hashlib.sha256(np.ascontiguousarray(feats).tobytes()).hexdigest() == row["input_features_sha256"]
    tensors = proc.plan_tensors(plan)  # type: ignore[arg-type]
    assert tensors["feature_attention_mask"].tolist() == [1] * row["valid_frames"]
    assert int(tensors["audio_feature_lengths"]) == row["valid_frames"]


@pytest.mark.parametrize("request_row", GOLDEN["requests"], ids=lambda r: f"{r['clip']}-{r['language']}")
def test_transcription_prompt_ids_equal_the_golden(request_row: dict[str, Any]) -> None:
    import base64
    import io

    rt = runtime()
    family = rt.family
    assert isinstance(family, Qwen3ASRFamily)
    row = next(r for r in GOLDEN["rows"] if r["clip"] == request_row["clip"])
    # the same float32 samples as an IEEE-float WAV (format 3), which decodes to them exactly
    samples = clip(row["samples"], row["seed"])
    buf = io.BytesIO()
    data = samples.astype("<f4").tobytes()
    fmt = b"fmt " + (16).to_bytes(4, "little") + (3).to_bytes(2, "little") + (1).to_bytes(2, "little") \
        + SR.to_bytes(4, "little") + (SR * 4).to_bytes(4, "little") + (4).to_bytes(2, "little") \
        + (32).to_bytes(2, "little")
    buf.write(b"RIFF" + (4 + len(fmt) + 8 + len(data)).to_bytes(4, "little") + b"WAVE" + fmt
              + b"data" + len(data).to_bytes(4, "little") + data)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}
    messages = family.transcription_messages(part, request_row["language"], request_row["prompt"])
    body = {"model": "asr", "messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    settings = Settings(model="asr")
    with ThreadPoolExecutor(2) as pool:
        pipe = Pipeline(rt, settings, MediaFetcher(settings.fetch), pool, PixelCache(16 << 20))
        prepared = asyncio.run(pipe.prepare(parse_chat_request(json.dumps(body).encode())))
    assert list(prepared.input_ids) == request_row["input_ids"]
    (batch,) = prepared.batches
    feats = np.ascontiguousarray(batch.tensors["input_features"][0])
    assert hashlib.sha256(feats.tobytes()).hexdigest() == row["input_features_sha256"]
