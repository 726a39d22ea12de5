"""models/audio_features.py against the transformers 5.24 processors of the three audio bundles.

For one waveform, the processor's ``input_features`` restricted to its mask's valid frames, the
mask's sum and the audio placeholder count in ``input_ids`` are the expected values; mmgate computes
only the valid frames.  The token formulas are checked against the processors' own functions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.audio_features import (
    log_mel_features,
    mel_filters,
    qwen2_5_omni_audio_tokens,
    qwen3_asr_audio_tokens,
    qwen3_omni_audio_tokens,
)
from tests.audio.references import ASR, OMNI3, OMNI25, Processors, mel_params

BUNDLES = (OMNI25, OMNI3, ASR)
#: samples at 16 kHz: three hops, 0.5 s - 1 (under Qwen3-ASR's min_length), 3 s + 77 (the slow tier covers 0.1-35 s and > 300 s)
LENGTHS = (480, 7999, 48077)


def waveform(n: int, seed: int) -> np.ndarray:
    """Noise plus a tone that grows to the end, so the loudest frames (the clamp's max) are the last ones."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return (0.2 * rng.standard_normal(n) + 0.6 * np.sin(0.07 * t) * (t / n)).astype(np.float32)


def test_mel_filters_equal_the_extractors(processors: Processors) -> None:
    for name in BUNDLES:
        fe = processors.get(name).feature_extractor
        np.testing.assert_array_equal(mel_filters(fe.feature_size, fe.n_fft, fe.sampling_rate), fe.mel_filters)


@pytest.mark.parametrize("name", BUNDLES)
@pytest.mark.parametrize("n", LENGTHS)
def test_valid_frames_mask_and_token_count_equal_the_processor(processors: Processors, name: str, n: int) -> None:
    samples = waveform(n, n)
    ref = processors.run(name, samples)
    valid = int(ref.mask.sum())
    assert np.all(ref.mask[:valid] == 1) and np.all(ref.mask[valid:] == 0)
    got = log_mel_features(samples, mel_params(name, processors), backend="torch")
    assert got.valid_frames == valid
    assert got.input_features.shape == (128, valid) and got.input_features.dtype == np.float32
    np.testing.assert_array_equal(got.input_features, ref.features[:, :valid])
    np.testing.assert_array_equal(got.attention_mask(), ref.mask[:valid])
    tokens = {OMNI25: qwen2_5_omni_audio_tokens, OMNI3: qwen3_omni_audio_tokens, ASR: qwen3_asr_audio_tokens}[name]
    assert tokens(got.valid_frames) == ref.audio_tokens


def test_qwen2_5_omni_end_frames_see_zeros_and_qwen3_omni_reflects(processors: Processors) -> None:
    """The padding each processor asks for decides the last frames: Qwen2.5-Omni pads to n_samples, Qwen3-Omni
    does not pad a lone clip, so their last valid frame differs while the frames far from the end agree."""
    samples = waveform(48000, 7)
    a = log_mel_features(samples, mel_params(OMNI25, processors), backend="torch").input_features
    b = log_mel_features(samples, mel_params(OMNI3, processors), backend="torch").input_features
    assert a.shape == b.shape == (128, 300)
    np.testing.assert_array_equal(a[:, :290], b[:, :290])
    assert not np.array_equal(a[:, -1], b[:, -1])


@pytest.mark.parametrize("name", BUNDLES)
def test_numpy_backend_is_within_1e_4_of_the_torch_path(processors: Processors, name: str) -> None:
    params = mel_params(name, processors)
    worst = 0.0
    for n in LENGTHS:
        samples = waveform(n, n + 1)
        a = log_mel_features(samples, params, backend="torch").input_features
        b = log_mel_features(samples, params, backend="numpy").input_features
        assert a.shape == b.shape
        worst = max(worst, float(np.abs(a - b).max()))
    print(f"{name}: numpy vs torch max|delta| {worst:.3g}")
    assert worst < 1e-4


def test_qwen3_omni_refuses_what_its_stft_cannot_frame(processors: Processors) -> None:
    params = mel_params(OMNI3, processors)
    with pytest.raises(RuntimeError):  # the reference itself
        processors.run(OMNI3, waveform(200, 0))
    with pytest.raises(GatewayError) as info:
        log_mel_features(waveform(200, 0), params)
    assert info.value.code is ErrorCode.AUDIO_TOO_SHORT
    assert log_mel_features(waveform(201, 0), params).valid_frames == 1


def test_token_formulas_equal_the_processors_functions() -> None:
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
        _get_feat_extract_output_lengths as omni25_lengths,
    )
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        _get_feat_extract_output_lengths as omni3_lengths,
    )

    frames = torch.arange(1, 30001)
    want25 = omni25_lengths(frames).tolist()
    want3 = omni3_lengths(frames, 50).tolist()
    assert [qwen2_5_omni_audio_tokens(f) for f in range(1, 30001)] == want25
    assert [qwen3_omni_audio_tokens(f, 50) for f in range(1, 30001)] == want3


def test_asr_formula_equals_its_processor(processors: Processors) -> None:
    frames = torch.arange(1, 10001)
    want = processors.asr._get_audio_token_length(frames, 50).tolist()
    assert [qwen3_asr_audio_tokens(f, 50) for f in range(1, 10001)] == want


@pytest.mark.parametrize("name", BUNDLES)
def test_planned_count_from_the_sample_count_equals_the_processors(processors: Processors, name: str) -> None:
    """``valid_frames(n)`` then the formula, from the sample count alone, as ``_get_num_multimodal_tokens``."""
    params = mel_params(name, processors)
    tokens = {OMNI25: qwen2_5_omni_audio_tokens, OMNI3: qwen3_omni_audio_tokens, ASR: qwen3_asr_audio_tokens}[name]
    proc = processors.get(name)
    lengths = [8000, 16000, 48077, 160 * 999 + 1, 560003]
    if name != ASR:  # Qwen3ASRProcessor has no _get_num_multimodal_tokens
        want = proc._get_num_multimodal_tokens(audio_lengths=lengths)["num_audio_tokens"]
        assert [tokens(params.valid_frames(n)) for n in lengths] == [int(w) for w in want]
