"""media/audio.py: bytes -> mono float32 at the extractor's rate, as vLLM's loader gives them; the refusals.

The expected waveforms come from vLLM's loader (``tests/audio/references.py``: its PyAV lines and
the real ``librosa.resample``); a sample of the container x rate x channel matrix runs here, the
whole matrix in ``test_audio_parity_slow.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.audio import decode_audio, resampled_length
from tests.audio.clips import (
    CODECS,
    ClipSpec,
    changing_adts,
    encode,
    make_clip,
    video_only_mp4,
    wav_header_only,
    waveform,
)
from tests.audio.references import transformers_load, vllm_load

LIMITS = {"max_input_bytes": 64 << 20, "max_duration_s": 600.0, "timeout_s": 30.0}

SAMPLE = [
    ClipSpec("wav", 16000, 1, 1.0),
    ClipSpec("flac", 44100, 2, 0.7),
    ClipSpec("mp3", 22050, 1, 1.2),
    ClipSpec("ogg_opus", 48000, 2, 0.5),
    ClipSpec("m4a_aac", 8000, 1, 0.9),
    ClipSpec("webm_opus", 16000, 2, 0.4),
]


@pytest.mark.parametrize("spec", SAMPLE, ids=lambda s: s.id)
def test_waveform_equals_vllm_loader(spec: ClipSpec) -> None:
    data = make_clip(spec)
    got = decode_audio(data, 16000, **LIMITS)
    want = vllm_load(data, 16000)
    assert got.samples.dtype == np.float32 and got.samples.ndim == 1
    assert got.sampling_rate == 16000 and got.source_channels == spec.channels
    np.testing.assert_array_equal(got.samples, want)
    assert got.num_samples == resampled_length(round(got.duration_s * got.source_rate), got.source_rate, 16000)


def test_wav_at_the_target_rate_is_the_pcm_over_32768() -> None:
    spec = ClipSpec("wav", 16000, 1, 0.25)
    pcm = (waveform(spec) * 32767).astype(np.int16)
    got = decode_audio(make_clip(spec), 16000, **LIMITS)
    np.testing.assert_array_equal(got.samples, pcm[0].astype(np.float32) / 32768)
    assert (got.source_rate, got.duration_s) == (16000, 0.25)


def test_stereo_is_the_float32_mean_of_its_channels() -> None:
    spec = ClipSpec("wav", 16000, 2, 0.2)
    pcm = (waveform(spec) * 32767).astype(np.int16).astype(np.float32) / 32768
    got = decode_audio(make_clip(spec), 16000, **LIMITS)
    np.testing.assert_array_equal(got.samples, pcm.mean(axis=0))


@pytest.mark.parametrize("spec", [ClipSpec("wav", 44100, 2, 0.6), ClipSpec("flac", 22050, 1, 0.6)], ids=lambda s: s.id)
def test_lossless_files_equal_transformers_soundfile_loader(spec: ClipSpec) -> None:
    """Where both decoders are lossless and both resample with soxr_hq, transformers' load_audio agrees exactly."""
    data = make_clip(spec)
    np.testing.assert_array_equal(decode_audio(data, 16000, **LIMITS).samples, transformers_load(data, 16000))


def _code(data: bytes, **limits: float) -> ErrorCode:
    with pytest.raises(GatewayError) as info:
        decode_audio(data, 16000, **{**LIMITS, **limits})
    return info.value.code


def test_refusals_have_stable_codes() -> None:
    clip = make_clip(ClipSpec("wav", 16000, 1, 2.0))
    assert _code(b"definitely not audio" * 10) is ErrorCode.AUDIO_DECODE_FAILED
    assert _code(b"") is ErrorCode.AUDIO_DECODE_FAILED
    assert _code(clip[: len(clip) // 3][:40]) is ErrorCode.AUDIO_DECODE_FAILED  # a header cut short
    assert _code(video_only_mp4()) is ErrorCode.AUDIO_NO_STREAM
    assert _code(wav_header_only()) is ErrorCode.AUDIO_EMPTY
    assert _code(clip, max_duration_s=1.5) is ErrorCode.AUDIO_TOO_LONG
    assert _code(clip, max_input_bytes=len(clip) - 1) is ErrorCode.MEDIA_TOO_LARGE
    assert _code(clip, timeout_s=0.0) is ErrorCode.AUDIO_DECODE_TIMEOUT


@pytest.mark.parametrize("parts", [[(44100, 2), (44100, 1)], [(44100, 1), (44100, 2)], [(44100, 2), (22050, 2)]],
                         ids=["stereo-then-mono", "mono-then-stereo", "44k-then-22k"])
def test_a_stream_whose_channels_or_rate_change_is_refused_as_the_reference_refuses_it(
        parts: list[tuple[int, int]]) -> None:
    """An ADTS file of a stereo part then a mono one decodes to frames of both: vLLM's loader stops at
    ``np.concatenate`` (a ValueError), mmgate answers ``audio_decode_failed``.  (With the frames gathered in an
    ``av.AudioFifo``, a mono frame written into a stereo fifo read a missing plane: the process crashed.)"""
    data = changing_adts(parts)
    if parts[0][0] == parts[1][0]:  # same rate: the reference refuses; a rate change it concatenates unnoticed
        with pytest.raises(ValueError):
            vllm_load(data, 16000)
    assert _code(data) is ErrorCode.AUDIO_DECODE_FAILED
    one = changing_adts(parts[:1])  # each part alone decodes
    assert decode_audio(one, 16000, **LIMITS).source_channels == parts[0][1]


def test_the_cap_is_enforced_on_decoded_samples_within_the_header_slack() -> None:
    """A 3 s clip under a 2.5 s cap passes the header check (1 s of slack for header rounding) and is stopped
    by the count of decoded samples."""
    data = encode(waveform(ClipSpec("mp3", 16000, 1, 3.0)), "mp3", 16000)
    assert _code(data, max_duration_s=2.5) is ErrorCode.AUDIO_TOO_LONG
    assert decode_audio(data, 16000, **{**LIMITS, "max_duration_s": 3.5}).duration_s >= 3.0


def test_refusal_statuses_are_caller_errors() -> None:
    from mmgate.errors import ERROR_TABLE

    for code in (ErrorCode.AUDIO_DECODE_FAILED, ErrorCode.AUDIO_NO_STREAM, ErrorCode.AUDIO_EMPTY,
                 ErrorCode.AUDIO_TOO_SHORT):
        assert ERROR_TABLE[code].status == 400
    for code in (ErrorCode.MEDIA_TOO_LARGE, ErrorCode.AUDIO_TOO_LONG, ErrorCode.AUDIO_DECODE_TIMEOUT):
        assert ERROR_TABLE[code].status == 413  # as video's size, pixel allowance and deadline


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_the_short_probe_gives_the_streams_and_samples_of_ffmpegs_default_probe(codec: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``probesize`` 2 KiB and ``analyzeduration`` 0 (media/audio.py) change nothing but the time: decoded with
    FFmpeg's default probing (the options removed), every container/codec at its lowest and highest rate, mono and
    stereo, gives the same rate, channels and samples."""
    import mmgate.media.audio as audio

    default = {k: v for k, v in audio._CONTAINER_OPTIONS.items() if k not in ("probesize", "analyzeduration")}
    assert default != audio._CONTAINER_OPTIONS
    rates = CODECS[codec].rates or (8000, 48000)
    for rate in (rates[0], rates[-1]):
        for channels in (1, 2):
            data = make_clip(ClipSpec(codec, rate, channels, 3.7))
            short = decode_audio(data, 16000, **LIMITS)
            with monkeypatch.context() as m:
                m.setattr(audio, "_CONTAINER_OPTIONS", default)
                full = decode_audio(data, 16000, **LIMITS)
            assert (short.source_rate, short.source_channels) == (full.source_rate, full.source_channels), codec
            assert full.source_channels == channels  # (opus decodes at 48 kHz whatever the input rate)
            assert np.array_equal(short.samples, full.samples), (codec, rate, channels)
