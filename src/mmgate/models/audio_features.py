"""Whisper log-mel features and audio token counts of the Qwen Omni / ASR line (Qwen2.5-Omni, Qwen3-Omni, Qwen3-ASR).

Stage: preprocess (audio).  In: float32 mono samples at the feature extractor's rate
(:func:`mmgate.media.audio.decode_audio`); out: :class:`AudioFeatures`, the log-mel
spectrogram of the clip's *valid* frames only (``[feature_size, valid_frames]``), the frame
count, and -- from the frame count alone, for planning -- the number of audio tokens.

Reference (transformers 5.24):

* ``models/whisper/feature_extraction_whisper.py`` ``WhisperFeatureExtractor.__call__`` and
  ``_torch_extract_fbank_features`` (Qwen2.5-Omni, Qwen3-Omni), and
  ``models/qwen3_asr/feature_extraction_qwen3_asr.py`` ``Qwen3ASRFeatureExtractor`` (Qwen3-ASR;
  the same STFT/mel/log steps, plus a zero pre-pad to ``min_length`` samples and a mel-axis
  pad to a multiple of ``2 * n_window`` frames, whose padding frames are masked out).
* What each processor asks of its extractor (the padding decides what the last frames see):
  ``Qwen2_5OmniProcessor._process_audio`` forces ``padding="max_length"`` (truncation on):
  the clip is zero-padded to ``n_samples`` (300 s in the bundle), so the end frames see
  zeros; ``Qwen3OmniMoeProcessor.audio_kwargs`` and ``Qwen3ASRProcessor.audio_kwargs`` ask
  ``padding=True`` (longest), ``truncation=False``: a clip processed alone is not padded,
  so ``torch.stft(center=True)`` reflects its own last samples.  In a batch of several clips
  (Qwen3-Omni's one processor call takes every audio item of a request; Qwen3-ASR's takes one clip
  per text) the shorter ones are zero-padded to
  the longest, so their end frames see zeros and the mask gives them ``ceil(n / hop)`` frames,
  one more than alone where ``n`` is not a hop multiple: the ``batch_longest`` argument below,
  planned by :func:`longest_in_batch` (switchable per clip: ``--no-audio-batch-padding``,
  docs/parity.md "Audio").

The reference computes all ``padded_length // hop_length`` frames and the mask marks the
valid ones.  Here only the frames that can differ from silence are computed: the buffer is
the clip plus ``n_fft + hop_length`` zeros, at least ``_MIN_FRAMES`` frames (or the
reference's own padded buffer when that is shorter), so every frame whose window reaches a sample is computed exactly as the
reference computes it, and the frames left out are all-zero windows whose log-mel is the
floor ``log10(1e-10)``, below any maximum -- so the clip's ``max - 8`` clamp is the same.

Two backends:

* ``torch`` (the reference; used whenever torch imports, as on every vLLM/TokenSpeed
  worker): the same calls as ``_torch_extract_fbank_features`` -- ``torch.stft`` on a
  ``[1, L]`` float32 tensor, ``hann_window(n_fft)``, ``|.|**2`` of all but the last frame,
  ``mel_filters.T @ magnitudes``, ``clamp(1e-10).log10()``, ``max - 8``, ``(x + 4) / 4``.
  Bit-exact to the processor's valid frames (tests/audio/test_features.py).
* ``numpy`` (the torch-free gateway, the ``mmgate[torch]`` extra left out): the same
  arithmetic in float32 with ``numpy.fft.rfft``; not bit-exact (different FFT and matmul
  summation order), max |Δ| against the torch path measured in docs/parity.md "Audio".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from mmgate.errors import ErrorCode, GatewayError

Backend = Literal["auto", "torch", "numpy"]

#: the floor ``torch.clamp(mel_spec, min=1e-10)`` puts on the mel power before ``log10``
_MEL_FLOOR = 1e-10
#: frames the cut buffer holds at least: torch's CPU matmul takes another kernel (1 ulp apart) for a
#: ``[128, 201] @ [201, T]`` with T below about 12 (measured, torch 2.14.1); 32 keeps the reference's
_MIN_FRAMES = 32


@dataclass(frozen=True, slots=True)
class WhisperMelParams:
    """The feature extractor's settings (``preprocessor_config.json``; the ASR bundle's
    ``processor_config.json`` ``feature_extractor``), with transformers' defaults."""

    feature_size: int = 128  # mel bins
    sampling_rate: int = 16000  # Hz the samples must be at
    hop_length: int = 160  # samples per frame step
    n_fft: int = 400  # window (= FFT) length
    n_samples: int = 480000  # chunk_length * sampling_rate: the "max_length" padding target
    min_length: int = 0  # Qwen3-ASR: clips shorter are zero-padded to this many samples first
    pad_to_max_length: bool = False  # Qwen2.5-Omni: pad (and truncate) to n_samples; else no padding
    contiguous_magnitudes: bool = True  # Whisper's ``.contiguous()`` on |stft|**2 (Qwen3-ASR's omits it)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, pad_to_max_length: bool,
                    contiguous_magnitudes: bool = True) -> WhisperMelParams:
        """From a feature-extractor config dict; refuses a dither (random noise cannot be reproduced)."""
        if float(cfg.get("dither", 0.0)) != 0.0:
            raise ValueError("a feature extractor with dither != 0 adds random noise; it cannot be reproduced")
        sampling_rate = int(cfg.get("sampling_rate", 16000))
        n_samples = int(cfg.get("n_samples", int(cfg.get("chunk_length", 30)) * sampling_rate))
        return cls(feature_size=int(cfg.get("feature_size", 128)), sampling_rate=sampling_rate,
                   hop_length=int(cfg.get("hop_length", 160)), n_fft=int(cfg.get("n_fft", 400)),
                   n_samples=n_samples, min_length=int(cfg.get("min_length", 0)),
                   pad_to_max_length=pad_to_max_length, contiguous_magnitudes=contiguous_magnitudes)

    def padded_length(self, num_samples: int, batch_longest: int = 0) -> int:
        """Samples the reference's buffer holds for a clip of ``num_samples``: processed alone
        (``batch_longest`` 0), or in a batch whose longest clip is ``batch_longest`` samples (after
        the ``min_length`` pre-pad: :func:`longest_in_batch`), which ``padding=True`` pads every clip to."""
        n = max(num_samples, self.min_length, batch_longest)
        return self.n_samples if self.pad_to_max_length else n

    def buffer_length(self, num_samples: int, batch_longest: int = 0) -> int:
        """Samples of the buffer :func:`log_mel_features` frames: the reference's padded buffer, cut ``n_fft
        + hop`` zeros past the clip, at least ``_MIN_FRAMES`` frames (module docstring).  A clip's
        features are a function of its samples and this length alone."""
        length = self.padded_length(num_samples, batch_longest)
        m = min(max(num_samples, self.min_length), length)
        return min(length, max(m + self.n_fft + self.hop_length, _MIN_FRAMES * self.hop_length))

    def batch_key(self, num_samples: int, batch_longest: int) -> int:
        """What the batch changes in a clip's features and frames: 0 when nothing (the clip is the batch's
        longest, or the extractor pads every clip to ``n_samples``), else :meth:`buffer_length` (a cache key
        part: every batch whose longest clip is at least ``n_fft + hop`` samples longer gives the same)."""
        if self.padded_length(num_samples, batch_longest) == self.padded_length(num_samples):
            return 0
        return self.buffer_length(num_samples, batch_longest)

    def too_short(self, num_samples: int, batch_longest: int = 0) -> bool:
        """Whether the reference cannot frame the clip: ``torch.stft(center=True)``'s reflect pad needs a
        padded buffer of more than ``n_fft // 2`` samples (a clip alone below :attr:`min_samples`; in a batch
        the longest clip pads the others)."""
        return self.padded_length(num_samples, batch_longest) <= self.n_fft // 2

    @property
    def min_samples(self) -> int:
        """Fewest samples the reference can frame: without padding, ``torch.stft(center=True)``'s reflect
        pad needs more than ``n_fft // 2`` samples (Qwen3-Omni raises on a shorter clip); 1 otherwise."""
        padded_min = self.n_samples if self.pad_to_max_length else self.min_length
        return 1 if padded_min > self.n_fft // 2 else self.n_fft // 2 + 1

    def valid_frames(self, num_samples: int, batch_longest: int = 0) -> int:
        """Frames the reference's mask marks valid (``attention_mask[:, ::hop]``, the last dropped
        when the padded length is not a multiple of ``hop``): ``min(ceil(m / hop), L // hop)``
        with ``m`` the (pre-padded, truncated) clip and ``L`` the padded length (:meth:`padded_length`)."""
        length = self.padded_length(num_samples, batch_longest)
        m = min(max(num_samples, self.min_length), length)
        return min(-(-m // self.hop_length), length // self.hop_length)


@dataclass(frozen=True, slots=True)
class AudioFeatures:
    """One clip's features, valid frames only."""

    input_features: npt.NDArray[np.float32]  # [feature_size, valid_frames], C-contiguous
    valid_frames: int  # = the reference mask's sum (``feature_attention_mask.sum(-1)``)

    def attention_mask(self) -> npt.NDArray[np.int32]:
        """The reference's mask over the frames sent: ones ``[valid_frames]`` (int32, as ``pad`` gives)."""
        return np.ones(self.valid_frames, dtype=np.int32)


# --- mel filter bank: transformers 5.24 audio_utils.mel_filter_bank(norm="slaney", mel_scale="slaney") ---

def _hertz_to_mel_slaney(freq: npt.NDArray[np.float64] | float) -> Any:
    """``audio_utils.hertz_to_mel(mel_scale="slaney")``."""
    logstep = 27.0 / np.log(6.4)
    if isinstance(freq, np.ndarray):
        mels = 3.0 * freq / 200.0
        log_region = freq >= 1000.0
        mels[log_region] = 15.0 + np.log(freq[log_region] / 1000.0) * logstep
        return mels
    return 15.0 + np.log(freq / 1000.0) * logstep if freq >= 1000.0 else 3.0 * freq / 200.0


def _mel_to_hertz_slaney(mels: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """``audio_utils.mel_to_hertz(mel_scale="slaney")``."""
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    freq[log_region] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mels[log_region] - 15.0))
    return freq


@lru_cache(maxsize=8)
def mel_filters(feature_size: int, n_fft: int, sampling_rate: int) -> npt.NDArray[np.float64]:
    """``WhisperFeatureExtractor.mel_filters``: ``mel_filter_bank(1 + n_fft // 2, feature_size, 0.0,
    8000.0, sampling_rate, norm="slaney", mel_scale="slaney")``, float64 ``[1 + n_fft // 2, feature_size]``."""
    bins = 1 + n_fft // 2
    mel_freqs = np.linspace(_hertz_to_mel_slaney(0.0), _hertz_to_mel_slaney(8000.0), feature_size + 2)
    filter_freqs = _mel_to_hertz_slaney(mel_freqs)
    fft_freqs = np.linspace(0, sampling_rate // 2, bins)
    # audio_utils._create_triangular_filter_bank
    filter_diff = np.diff(filter_freqs)
    slopes = np.expand_dims(filter_freqs, 0) - np.expand_dims(fft_freqs, 1)
    down_slopes = -slopes[:, :-2] / filter_diff[:-1]
    up_slopes = slopes[:, 2:] / filter_diff[1:]
    filters = np.maximum(np.zeros(1), np.minimum(down_slopes, up_slopes))
    enorm = 2.0 / (filter_freqs[2:feature_size + 2] - filter_freqs[:feature_size])
    filters *= np.expand_dims(enorm, 0)
    filters.setflags(write=False)
    return filters


# --- features ---

def torch_available() -> bool:
    """Whether torch imports (the reference STFT path)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def longest_in_batch(params: WhisperMelParams, num_samples: Sequence[int]) -> int:
    """The length (samples) ``padding=True`` pads a batch of clips of ``num_samples`` to: the longest after
    the ``min_length`` pre-pad (transformers 5.24 ``SequenceFeatureExtractor.pad`` with
    ``PaddingStrategy.LONGEST``, after ``Qwen3ASRFeatureExtractor.__call__``'s pre-pad); 0 for no clips."""
    return max((max(n, params.min_length) for n in num_samples), default=0)


def _buffer(samples: npt.NDArray[np.float32], params: WhisperMelParams,
            batch_longest: int = 0) -> npt.NDArray[np.float32]:
    """The reference's padded buffer, cut ``n_fft + hop`` zeros past the clip (module docstring)."""
    m = min(len(samples), params.padded_length(len(samples), batch_longest))
    buf = np.zeros(params.buffer_length(len(samples), batch_longest), dtype=np.float32)
    buf[:m] = samples[:m]
    return buf


def _log_mel_torch(buf: npt.NDArray[np.float32], params: WhisperMelParams) -> npt.NDArray[np.float32]:
    """``WhisperFeatureExtractor._torch_extract_fbank_features`` on a batch of one (``[1, L]``), float32."""
    import torch

    waveform = torch.from_numpy(buf[None, :]).to("cpu", torch.float32)
    window = torch.hann_window(params.n_fft, device="cpu")
    stft = torch.stft(waveform, params.n_fft, params.hop_length, window=window, return_complex=True)
    magnitudes = stft[..., :-1].abs() ** 2
    if params.contiguous_magnitudes:
        magnitudes = magnitudes.contiguous()
    filters = torch.from_numpy(mel_filters(params.feature_size, params.n_fft, params.sampling_rate).copy())
    mel_spec = filters.to("cpu", torch.float32).T @ magnitudes
    log_spec = torch.clamp(mel_spec, min=_MEL_FLOOR).log10()
    max_val = log_spec.max(dim=2, keepdim=True)[0].max(dim=1, keepdim=True)[0]
    log_spec = torch.maximum(log_spec, max_val - 8.0)
    log_spec = (log_spec + 4.0) / 4.0
    return log_spec.numpy()[0]


@lru_cache(maxsize=4)
def _hann_f32(n_fft: int) -> npt.NDArray[np.float32]:
    """``torch.hann_window(n_fft)`` (periodic): ``0.5 - 0.5 cos(2 pi k / n)``, float32."""
    k = np.arange(n_fft, dtype=np.float64)
    window = (0.5 - 0.5 * np.cos(2.0 * np.pi * k / n_fft)).astype(np.float32)
    window.setflags(write=False)
    return window


def _log_mel_numpy(buf: npt.NDArray[np.float32], params: WhisperMelParams) -> npt.NDArray[np.float32]:
    """The torch path's arithmetic in float32 numpy (center=True reflect padding, rfft)."""
    half = params.n_fft // 2
    padded = np.pad(buf, (half, half), mode="reflect")
    frames = 1 + (len(padded) - params.n_fft) // params.hop_length
    view = np.lib.stride_tricks.as_strided(
        padded, shape=(frames - 1, params.n_fft), strides=(padded.strides[0] * params.hop_length, padded.strides[0]),
        writeable=False)
    spec = np.fft.rfft(view * _hann_f32(params.n_fft), axis=-1)
    magnitudes = (spec.real * spec.real + spec.imag * spec.imag).astype(np.float32, copy=False)
    filters = mel_filters(params.feature_size, params.n_fft, params.sampling_rate).astype(np.float32)
    mel_spec = filters.T @ magnitudes.T
    log_spec = np.log10(np.maximum(mel_spec, np.float32(_MEL_FLOOR)))
    log_spec = np.maximum(log_spec, log_spec.max() - np.float32(8.0))
    return ((log_spec + np.float32(4.0)) / np.float32(4.0)).astype(np.float32, copy=False)


def log_mel_features(samples: npt.NDArray[np.float32], params: WhisperMelParams,
                     backend: Backend = "auto", batch_longest: int = 0) -> AudioFeatures:
    """The clip's log-mel features, valid frames only (module docstring).

    Args:
        samples: float32 mono ``[n]`` at ``params.sampling_rate`` (n >= 1).
        params: the extractor's settings and the processor's padding.
        backend: ``"torch"`` (the reference, bit-exact), ``"numpy"`` (torch-free, not bit-exact),
            ``"auto"``: torch when it imports.
        batch_longest: the clip's features in a processor call with other clips, the longest of them
            this many samples (:func:`longest_in_batch`); 0: the clip alone.

    Returns:
        ``input_features`` float32 ``[feature_size, valid_frames]``; ``valid_frames`` = the mask's sum.

    Raises:
        GatewayError(AUDIO_TOO_SHORT): a clip the reference cannot frame (``params.too_short``: alone, fewer
            than ``params.min_samples`` samples).
    """
    if samples.ndim != 1:
        raise ValueError("samples must be a 1-D array")
    if params.too_short(len(samples), batch_longest):
        raise GatewayError(ErrorCode.AUDIO_TOO_SHORT,
                           f"audio is too short: {len(samples)} samples at {params.sampling_rate} Hz, the model "
                           f"needs at least {params.min_samples}")
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    buf = _buffer(samples, params, batch_longest)
    use_torch = backend == "torch" or (backend == "auto" and torch_available())
    log_spec = _log_mel_torch(buf, params) if use_torch else _log_mel_numpy(buf, params)
    valid = params.valid_frames(len(samples), batch_longest)
    return AudioFeatures(input_features=np.ascontiguousarray(log_spec[:, :valid]), valid_frames=valid)


# --- audio token counts (pure; from the mask's sum) ---

def qwen2_5_omni_audio_tokens(feature_frames: int) -> int:
    """Audio tokens of a Qwen2.5-Omni clip with ``feature_frames`` valid frames: two stride-2 steps,
    ``x = (L - 1) // 2 + 1``, then ``(x - 2) // 2 + 1``.  transformers 5.24
    ``models/qwen2_5_omni/processing_qwen2_5_omni.py`` ``_get_feat_extract_output_lengths``."""
    x = (feature_frames - 1) // 2 + 1
    return (x - 2) // 2 + 1


def qwen3_omni_audio_tokens(feature_frames: int, n_window: int = 50) -> int:
    """Audio tokens of a Qwen3-Omni / Qwen3-ASR clip with ``feature_frames`` valid frames: 13 per full
    chunk of ``2 * n_window`` frames, and three stride-2 steps over the remainder.  transformers 5.24
    ``models/qwen3_omni_moe/processing_qwen3_omni_moe.py`` ``_get_feat_extract_output_lengths`` and
    ``models/qwen3_asr/processing_qwen3_asr.py`` ``Qwen3ASRProcessor._get_audio_token_length`` (the same
    formula).  A remainder of 0 frames gives 0 tokens for that part (``(((-1)//2+1)-1)//2+1 - 1)//2+1 = 0``)."""
    chunk = n_window * 2
    rest = feature_frames % chunk
    x = (rest - 1) // 2 + 1
    return ((x - 1) // 2 + 1 - 1) // 2 + 1 + (feature_frames // chunk) * 13


def qwen3_asr_audio_tokens(feature_frames: int, n_window: int = 50) -> int:
    """Qwen3-ASR: :func:`qwen3_omni_audio_tokens` (``Qwen3ASRProcessor._get_audio_token_length``)."""
    return qwen3_omni_audio_tokens(feature_frames, n_window)

