"""The reference loaders and processors the audio tests compare with.

* :func:`vllm_load` -- vLLM's audio path for bytes: ``vllm/multimodal/media/audio.py``
  ``load_audio_pyav`` (PyAV decode at the native rate through ``AudioResampler(format="fltp")``,
  ``np.mean(axis=0)``) followed by ``vllm/multimodal/audio.py`` ``AudioResampler(method="librosa")``
  (``librosa.resample``, the real library).  vLLM itself is not installed; its PyAV lines are
  reproduced here as they read upstream.
* :func:`transformers_load` -- transformers 5.24 ``audio_utils.load_audio(..., backend="soundfile")``,
  called as is (libsndfile decode + soxr_hq; the torchcodec backend needs FFmpeg libraries this
  machine does not have).
* :class:`Processors` -- the three bundles' ``AutoProcessor``s and how each is asked for audio.
"""

from __future__ import annotations

import base64
import io
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import av
import numpy as np

from mmgate.models.audio_features import WhisperMelParams
from tests.conftest import bundle_dir

OMNI25 = "Qwen--Qwen2.5-Omni-7B"
OMNI3 = "Qwen--Qwen3-Omni-30B-A3B-Instruct"
ASR = "Qwen--Qwen3-ASR-0.6B"


def vllm_load(data: bytes, target_sr: int) -> np.ndarray:
    """vLLM ``AudioMediaIO.load_bytes`` (``load_audio_pyav``) + ``AudioResampler(target_sr).resample``."""
    import librosa

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        native_sr = stream.rate
        resampler = av.AudioResampler(format="fltp", rate=native_sr)
        chunks = []
        for frame in container.decode(stream):
            for out_frame in resampler.resample(frame):
                chunks.append(out_frame.to_ndarray())
        for out_frame in resampler.resample(None):
            chunks.append(out_frame.to_ndarray())
    audio = np.concatenate(chunks, axis=-1)
    if audio.ndim > 1:
        audio = audio.mean(axis=0)
    audio = audio.astype(np.float32)
    if native_sr == target_sr:
        return audio
    return librosa.resample(audio, orig_sr=float(native_sr), target_sr=float(target_sr))


def transformers_load(data: bytes, target_sr: int) -> np.ndarray | None:
    """transformers' ``load_audio`` on the soundfile backend; None where it refuses the format."""
    from transformers.audio_utils import load_audio

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_audio(base64.b64encode(data).decode(), sampling_rate=target_sr, backend="soundfile")
    except RuntimeError:  # m4a / webm: "needs torchcodec"
        return None


@dataclass
class ProcessorResult:
    features: np.ndarray  # [mel, frames] as the processor returns them (padded)
    mask: np.ndarray  # [frames] int
    audio_tokens: int  # audio placeholder ids in input_ids


class Processors:
    """The three bundles' processors, loaded once."""

    @cached_property
    def omni25(self) -> Any:
        return _auto(OMNI25)

    @cached_property
    def omni3(self) -> Any:
        return _auto(OMNI3)

    @cached_property
    def asr(self) -> Any:
        return _auto(ASR)

    def get(self, name: str) -> Any:
        return {OMNI25: self.omni25, OMNI3: self.omni3, ASR: self.asr}[name]

    def run(self, name: str, samples: np.ndarray) -> ProcessorResult:
        """``processor(text=[audio bos + audio token + audio eos], audio=[samples])``, as its own kwargs ask."""
        proc = self.get(name)
        text = proc.audio_bos_token + proc.audio_token + proc.audio_eos_token
        out = proc(text=[text], audio=[samples], return_tensors="pt")
        mask_key = "input_features_mask" if name == ASR else "feature_attention_mask"
        audio_id = proc.tokenizer.convert_tokens_to_ids(proc.audio_token)
        return ProcessorResult(features=out["input_features"][0].numpy(), mask=out[mask_key][0].numpy(),
                               audio_tokens=int((out["input_ids"][0] == audio_id).sum()))


def _auto(name: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(bundle_dir(name)))


def mel_params(name: str, processors: Processors) -> WhisperMelParams:
    """mmgate's settings for a bundle, from its feature extractor's own config."""
    fe = processors.get(name).feature_extractor
    return WhisperMelParams.from_config(fe.to_dict(), pad_to_max_length=(name == OMNI25),
                                        contiguous_magnitudes=(name != ASR))
