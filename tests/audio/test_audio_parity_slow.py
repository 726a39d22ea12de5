"""Slow tier: the audio differential corpus (issue 23 acceptance), >= 50 generated clips.

Every container/codec (wav, flac, mp3, ogg/opus, m4a/aac, webm/opus) at every rate its encoder takes
among 8, 16, 22.05, 44.1 and 48 kHz, mono and stereo, lengths cycling 0.1 s .. 35 s, plus one clip
longer than Qwen2.5-Omni's 300 s window.  For each clip:

* the waveform mmgate decodes equals vLLM's loader's exactly (PyAV + ``librosa.resample``), and its
  max |delta| against transformers' ``load_audio`` (soundfile backend) is recorded (exact on wav/flac;
  the other decoders differ -- docs/parity.md "Audio");
* given that waveform, the valid ``input_features`` frames, the mask and the audio placeholder count
  in ``input_ids`` equal the processors' of Qwen3-Omni and Qwen3-ASR on every clip, and Qwen2.5-Omni's
  on every second clip and the long one (its processor pads each clip to 300 s, about 0.4 s of CPU a
  call; all of them would take the tier past its 60 s budget on 2 cores).

The same clips in whole requests with images and a video, through the pipeline: test_audio_mixed_requests_slow.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mmgate.media.audio import decode_audio
from mmgate.models.audio_features import (
    log_mel_features,
    qwen2_5_omni_audio_tokens,
    qwen3_asr_audio_tokens,
    qwen3_omni_audio_tokens,
)
from tests.audio.clips import CODECS, RATES, ClipSpec, make_clip
from tests.audio.references import ASR, OMNI3, OMNI25, Processors, mel_params, transformers_load, vllm_load

pytestmark = pytest.mark.slow

LENGTHS_S = (0.1, 0.7, 2.3, 5.0, 11.1, 35.0, 1.6)
LIMITS = {"max_input_bytes": 64 << 20, "max_duration_s": 600.0, "timeout_s": 60.0}
TOKENS = {OMNI25: qwen2_5_omni_audio_tokens, OMNI3: qwen3_omni_audio_tokens, ASR: qwen3_asr_audio_tokens}


def corpus() -> list[ClipSpec]:
    lengths = itertools.cycle(LENGTHS_S)
    specs = [ClipSpec(codec.name, rate, channels, next(lengths))
             for codec in CODECS.values() for rate in RATES if codec.rates is None or rate in codec.rates
             for channels in (1, 2)]
    specs.append(ClipSpec("wav", 8000, 1, 301.0))  # past Qwen2.5-Omni's n_samples (300 s): truncated there
    return specs


def test_corpus_covers_the_acceptance_matrix() -> None:
    specs = corpus()
    assert len(specs) >= 50
    assert {s.codec for s in specs} == set(CODECS)
    assert {s.rate for s in specs} == set(RATES)
    assert {s.channels for s in specs} == {1, 2}
    assert min(s.seconds for s in specs) == 0.1 and 35.0 in {s.seconds for s in specs}
    assert max(s.seconds for s in specs) > 300


def test_audio_differential_corpus(processors: Processors) -> None:
    params = {name: mel_params(name, processors) for name in TOKENS}
    residual: dict[str, float] = {}
    for i, spec in enumerate(corpus()):
        data = make_clip(spec)
        got = decode_audio(data, 16000, **LIMITS)
        np.testing.assert_array_equal(got.samples, vllm_load(data, 16000), err_msg=spec.id)
        hf = transformers_load(data, 16000)
        if hf is not None:
            n = min(len(hf), got.num_samples)
            delta = float(np.abs(hf[:n] - got.samples[:n]).max()) if len(hf) == got.num_samples else float("inf")
            residual[spec.codec] = max(residual.get(spec.codec, 0.0), delta)
            if spec.codec in ("wav", "flac"):
                assert delta == 0.0, spec.id
        for name in TOKENS:
            if name == OMNI25 and i % 2 and spec.seconds <= 300:
                continue
            ref = processors.run(name, got.samples)
            valid = int(ref.mask.sum())
            feats = log_mel_features(got.samples, params[name], backend="torch")
            assert feats.valid_frames == valid, (spec.id, name)
            np.testing.assert_array_equal(feats.input_features, ref.features[:, :valid], err_msg=f"{spec.id} {name}")
            assert TOKENS[name](feats.valid_frames) == ref.audio_tokens, (spec.id, name)
    print("waveform max|delta| vs transformers load_audio(backend='soundfile'), per codec:", residual)
