"""The Qwen3-ASR family (``model_type`` ``qwen3_asr``): audio only, and its transcription prompt.

Stage: plan / preprocess / expand for audio.  In: one decoded clip (:class:`~mmgate.types.DecodedAudio`,
mono float32 at 16 kHz); out: its log-mel features (valid frames), the feature mask and length, and the
``<|audio_pad|>`` run replacing its anchor.  Also :func:`transcription_messages`, the conversation of a
transcription request (``POST /v1/audio/transcriptions``), and :func:`strip_language_prefix`.

Bundle: the transformers-native ``-hf`` layout (flat ``config.json``: ``audio_config`` and
``audio_token_id`` at the top, no ``thinker_config``); the feature extractor's settings under
``processor_config.json`` ``feature_extractor`` (older layouts: ``preprocessor_config.json``).

Reference (transformers 5.24):

* ``models/qwen3_asr/feature_extraction_qwen3_asr.py`` ``Qwen3ASRFeatureExtractor.__call__``: clips under
  ``min_length`` (8000) samples zero-padded first, the mask left as the padded clip's; Whisper's torch
  STFT log-mel without ``.contiguous()`` on the magnitudes; the mel axis right-padded with zeros to a
  multiple of ``2 * n_window`` frames, the mask 0 there.  Only the valid frames are computed and sent
  (:func:`mmgate.models.audio_features.log_mel_features` with ``min_length`` and
  ``contiguous_magnitudes=False``): the mel-axis padding is zeros under a zero mask, which the engine
  re-creates (TokenSpeed's ``qwen3_audio.py`` trims to ``audio_feature_lengths``; the reference engine pads
  to a multiple of 100 again, ``mmgate.refengine.mm_inputs``).  Each clip alone: ``Qwen3ASRProcessor``
  takes one clip per text (``validate_inputs``: "they must match 1:1"), so a request's clips are never one
  extractor batch, unlike Qwen3-Omni's (:class:`~mmgate.models.family.BatchPlanner`).
* ``models/qwen3_asr/processing_qwen3_asr.py`` ``Qwen3ASRProcessor``: ``audio_kwargs`` ``padding=True``,
  ``truncation=False``, ``n_window=50`` (the processor's, passed over the extractor's own);
  ``_get_audio_token_length(mask.sum(-1), n_window)`` tokens (13 per 100 frames plus three stride-2 steps
  over the rest, :func:`~mmgate.models.audio_features.qwen3_asr_audio_tokens`); ``replace_audio_token``:
  the chat template's one ``<|audio_pad|>`` becomes that many ``<|audio_pad|>`` (the template writes
  ``<|audio_start|>`` / ``<|audio_end|>`` around it), so the anchor and the placeholder are 151676.
* ``Qwen3ASRProcessor.apply_transcription_request``: a system message with ``prompt`` (only when given), a
  user message with the audio, an assistant message ``language {Name}<asr_text>`` (empty without a
  language; codes and names resolved by ``audio_utils.resolve_language`` over ``LANGUAGE_CODE_TO_NAME``),
  rendered with ``continue_final_message=True``.  The bundle's template always writes the system turn
  (empty without a prompt) and ignores user text.

Wire (TokenSpeed): one AUDIO item per clip, as smg's ``qwen3_asr.rs`` lays it out
(``encoder_field_layouts_for(Audio)``: everything batched): ``input_features`` ``[1, mel, frames]``
(``frames`` the longest clip of the request: a shorter clip's share is zero-padded, its length says where it
ends), ``feature_attention_mask`` int64 ``[1, frames]``, ``audio_feature_lengths`` int64 ``[1]``.

Limit: 10 clips per request, smg's ``Qwen3AsrSpec::modality_limits`` (audio 10; see docs/families.md).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.audio_features import WhisperMelParams, log_mel_features, qwen3_asr_audio_tokens
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.models.bundle import ModelBundle
from mmgate.models.family import AudioProcessor, MediaProcessor, processor_map
from mmgate.models.llava import check_no_hints
from mmgate.types import DecodedAudio, ItemHints, ItemPlan, Modality, Replacement, TensorLayout, TensorSpec

__all__ = ["FAMILY", "LANGUAGE_CODE_TO_NAME", "Qwen3ASRAudio", "Qwen3ASRFamily", "StreamingTranscript",
           "parse_transcript", "resolve_language", "strip_language_prefix", "transcription_messages"]

#: clips per request (smg ``registry/qwen3_asr.rs`` ``modality_limits``: audio 10)
AUDIO_LIMIT = 10
#: ``Qwen3ASRProcessor.audio_kwargs["n_window"]`` (the processor's, "should match config.n_window")
N_WINDOW = 50

#: ``processing_qwen3_asr.py`` ``LANGUAGE_CODE_TO_NAME`` (transformers 5.24): "The ASR model was trained with
#: these full names in the forced-language suffix"
LANGUAGE_CODE_TO_NAME: Mapping[str, str] = {
    "ar": "Arabic", "yue": "Cantonese", "zh": "Chinese", "cs": "Czech", "da": "Danish", "nl": "Dutch",
    "en": "English", "fil": "Filipino", "fi": "Finnish", "fr": "French", "de": "German", "el": "Greek",
    "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean",
    "mk": "Macedonian", "ms": "Malay", "fa": "Persian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
    "ru": "Russian", "es": "Spanish", "sv": "Swedish", "th": "Thai", "tr": "Turkish", "vi": "Vietnamese",
}

_SPECS = (
    TensorSpec("input_features", "float32", TensorLayout.BATCHED, primary=True),
    TensorSpec("feature_attention_mask", "int64", TensorLayout.BATCHED),
    TensorSpec("audio_feature_lengths", "int64", TensorLayout.BATCHED),
)


def resolve_language(language: str) -> str:
    """The full name the model was trained with for ``language`` (an ISO code or a name, any case):
    transformers 5.24 ``audio_utils.resolve_language(language, LANGUAGE_CODE_TO_NAME, return_code=False)``.

    Raises:
        GatewayError(INVALID_REQUEST): a language the model does not know (``param`` ``language``).
    """
    lowered = language.lower()
    for code, name in LANGUAGE_CODE_TO_NAME.items():
        if lowered in (code.lower(), name.lower()):
            return name
    raise GatewayError(ErrorCode.INVALID_REQUEST, "language is not one the model transcribes; expected one of "
                       + ", ".join(LANGUAGE_CODE_TO_NAME), "language")


def transcription_messages(audio_part: Mapping[str, Any], language: str | None,
                           prompt: str | None) -> list[dict[str, Any]]:
    """The chat messages of a transcription request, rendered with ``continue_final_message``:
    ``Qwen3ASRProcessor.apply_transcription_request`` (transformers 5.24) with ``audio_part`` (an
    ``input_audio`` chat part) for the audio: ``[system prompt]`` (only when ``prompt`` is not None),
    ``user [audio]``, ``assistant "language {Name}<asr_text>"`` (``""`` without a language)."""
    messages: list[dict[str, Any]] = []
    if prompt is not None:
        messages.append({"role": "system", "content": [{"type": "text", "text": prompt}]})
    messages.append({"role": "user", "content": [dict(audio_part)]})
    prefill = f"language {resolve_language(language)}<asr_text>" if language is not None else ""
    messages.append({"role": "assistant", "content": [{"type": "text", "text": prefill}]})
    return messages


#: the tag between the language prefix and the transcript (``<asr_text>``, 151704, not special)
ASR_TEXT_TAG = "<asr_text>"
_LANGUAGE_PREFIX = "language "
#: vLLM ``qwen3_asr.py`` ``_MAX_STREAMING_PREFIX_CHARS``: a text that looks like a prefix this long is held back
_MAX_STREAMING_PREFIX_CHARS = 50


def strip_language_prefix(text: str) -> str:
    """The transcript of a generated text: what follows the first ``<asr_text>``, stripped (the model writes
    ``language {Name}<asr_text>`` first when no language was forced).  transformers 5.24 ``_parse_single_output``
    (``extract_transcription``, without its repetition fix-up; vLLM ``_post_process_qwen3_asr_output`` cuts at
    the last tag and does not strip); a text without the tag is returned stripped."""
    return parse_transcript(text)[1]


def parse_transcript(text: str) -> tuple[str | None, str]:
    """``(language, transcript)`` as transformers 5.24 ``_parse_single_output`` reads a decoded output (the
    prefix's first line ``language X``; ``language None`` is None), without its repetition fix-up."""
    text = text.strip()
    prefix, tag, rest = text.partition(ASR_TEXT_TAG)
    if not tag:
        return None, text
    prefix = prefix.strip()
    language: str | None = None
    for line in prefix.splitlines():
        line = line.strip()
        if not line:
            continue
        language = line[len(_LANGUAGE_PREFIX):].strip() if line.lower().startswith(_LANGUAGE_PREFIX) else line
        break
    if language is not None and language.lower() == "none":
        language = None
    return language or None, rest.strip()


class StreamingTranscript:
    """vLLM ``qwen3_asr.py`` ``Qwen3ASRStreamingPostProcessor.process_delta``: while the text so far could be
    a ``language X<asr_text>`` prefix (it is a prefix of ``"language "``, or starts with it, under 50 characters
    and without a newline) nothing is sent; once ``<asr_text>`` shows, what follows it is sent; a text that
    turns out not to be structured is sent as it is.  The transcript is cut at the first tag (as
    :func:`parse_transcript`) and its leading space dropped, so the streamed deltas join to the non-streamed
    ``text`` up to trailing white space."""

    def __init__(self) -> None:
        self.raw = ""
        self.emitted = ""
        self.structured: bool | None = None

    def feed(self, delta: str, finished: bool) -> str:
        self.raw += delta
        if self.structured is None:
            head = self.raw.lstrip()
            maybe = head == "" or _LANGUAGE_PREFIX.startswith(head) or (
                head.startswith(_LANGUAGE_PREFIX) and len(head) < _MAX_STREAMING_PREFIX_CHARS and "\n" not in head)
            if maybe and ASR_TEXT_TAG not in self.raw:
                if not finished:
                    return ""
                self.structured = False
            else:
                self.structured = ASR_TEXT_TAG in self.raw
        text = self.raw.partition(ASR_TEXT_TAG)[2] if self.structured else self.raw
        text = text.lstrip()
        if finished:
            text = text.rstrip()
        new = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text if text.startswith(self.emitted) else self.emitted
        return new


@dataclass(slots=True)  # not frozen: the protocol's attributes are plain (settable) ones
class Qwen3ASRAudio:
    """The audio processor: Whisper log-mel with Qwen3-ASR's settings, the ``<|audio_pad|>`` run."""

    model_type: str
    params: WhisperMelParams
    audio_token_id: int  # <|audio_pad|>: the anchor the template leaves and every token of the run
    sampling_rate: int = 16000  # Hz: ``params.sampling_rate`` (the protocol's attribute)
    n_window: int = N_WINDOW
    modality: Modality = Modality.AUDIO
    specs: tuple[TensorSpec, ...] = _SPECS
    device_normalizable: bool = False

    @property
    def anchor_token_id(self) -> int:
        return self.audio_token_id

    @property
    def placeholder_token_id(self) -> int:
        return self.audio_token_id

    @property
    def fingerprint(self) -> str:
        return f"qwen3_asr:{self.model_type}:{self.params!r}:{self.n_window}:{self.audio_token_id}"

    def check_hints(self, hints: ItemHints, param: str) -> None:
        check_no_hints(hints, param, self.model_type)

    def plan(self, audio: DecodedAudio, hints: ItemHints) -> ItemPlan:
        """Valid frames (``floor(max(n, min_length) / hop)``) and their token count; ``detail``:
        ``(samples, valid_frames)``."""
        if audio.sampling_rate != self.params.sampling_rate:
            raise ValueError(f"audio at {audio.sampling_rate} Hz, the extractor takes {self.params.sampling_rate}")
        frames = self.params.valid_frames(audio.num_samples)
        shapes = (("input_features", (self.params.feature_size, frames)),
                  ("feature_attention_mask", (frames,)), ("audio_feature_lengths", ()))
        return ItemPlan(modality=Modality.AUDIO, original_hw=(1, audio.num_samples), resized_hw=(1, frames),
                        num_tokens=qwen3_asr_audio_tokens(frames, self.n_window), shapes=shapes,
                        detail=(audio.num_samples, frames))

    def plan_tensors(self, plan: ItemPlan) -> dict[str, np.ndarray]:
        frames = plan.detail[1]
        return {"feature_attention_mask": np.ones(frames, dtype=np.int64),
                "audio_feature_lengths": np.array(frames, dtype=np.int64)}

    def preprocess(self, audio: DecodedAudio, plan: ItemPlan, raw: bool = False) -> npt.NDArray[np.float32]:
        """``input_features`` of the valid frames, float32 ``[mel, valid_frames]``."""
        return log_mel_features(audio.samples, self.params).input_features

    def expand(self, plan: ItemPlan) -> Replacement:
        """``num_tokens`` x ``<|audio_pad|>``, all of it the placeholder range."""
        return Replacement(token_ids=(self.audio_token_id,) * plan.num_tokens, embed_offset=0,
                           embed_length=plan.num_tokens)


def _extractor_config(bundle: ModelBundle) -> dict[str, Any]:
    """The feature extractor's settings: ``processor_config.json`` ``feature_extractor`` (the ``-hf`` layout),
    else ``preprocessor_config.json``."""
    nested = bundle.processor_config.get("feature_extractor")
    return dict(nested) if isinstance(nested, dict) else dict(bundle.preprocessor_config)


class Qwen3ASRFamily:
    """Qwen3-ASR: audio only, 1-D positions (the Qwen3 decoder), token-level updates."""

    model_types: tuple[str, ...] = ("qwen3_asr",)
    mrope = False
    vllm_video_ids = False
    text_updates: frozenset[Modality] = frozenset()
    #: items per request (smg's, module docstring)
    limits: Mapping[Modality, int] = {Modality.AUDIO: AUDIO_LIMIT}

    def __init__(self, audio: Qwen3ASRAudio, reserved: tuple[str, ...]) -> None:
        self.audio = audio
        self._reserved = reserved
        proc: AudioProcessor = audio
        self._processors: Mapping[Modality, MediaProcessor] = processor_map(proc)

    @property
    def processors(self) -> Mapping[Modality, MediaProcessor]:
        """``{AUDIO: the audio processor}``."""
        return self._processors

    @property
    def fingerprint(self) -> str:
        return self.audio.fingerprint

    @property
    def reserved_tokens(self) -> tuple[str, ...]:
        """``<|audio_start|>``, ``<|audio_pad|>``, ``<|audio_end|>`` (``<asr_text>`` is model text, not reserved)."""
        return self._reserved

    @property
    def image(self) -> None:
        return None

    @property
    def video(self) -> None:
        return None

    # --- transcription (mmgate.models.family.Transcriber) ---

    def transcription_messages(self, audio_part: Mapping[str, object], language: str | None,
                               prompt: str | None) -> list[dict[str, object]]:
        return transcription_messages(audio_part, language, prompt)  # type: ignore[return-value]

    def language_name(self, language: str) -> str:
        return resolve_language(language)

    def transcript(self, generated: str) -> tuple[str | None, str]:
        return parse_transcript(generated)

    def transcript_stream(self) -> StreamingTranscript:
        return StreamingTranscript()

    def clip_seconds(self, plan: ItemPlan[Hashable]) -> float:
        assert isinstance(plan.detail, tuple)  # the audio plan of this family: (samples, frames)
        return int(plan.detail[0]) / self.audio.sampling_rate

    @classmethod
    def from_bundle(cls, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                    video_backend: ImageBackend | None = None,
                    video_sampling: FrameSampling = FrameSampling.VLLM) -> Qwen3ASRFamily:
        """Read the extractor settings and the audio token ids from ``bundle`` (the backends do not apply)."""
        cfg = bundle.config
        nested = cfg.get("thinker_config")
        thinker: Mapping[str, Any] = nested if isinstance(nested, dict) else cfg
        tok = bundle.tokenizer_config
        pad = str(tok.get("audio_token", "<|audio_pad|>"))
        audio_id = thinker.get("audio_token_id", tokenizer.token_id(pad))
        if audio_id is None:
            raise ValueError(f"{bundle.name}: no audio token id in config.json or the tokenizer")
        params = WhisperMelParams.from_config(_extractor_config(bundle), pad_to_max_length=False,
                                              contiguous_magnitudes=False)
        audio = Qwen3ASRAudio(bundle.model_type, params, int(audio_id), params.sampling_rate)
        reserved = tuple(str(tok.get(k, d)) for k, d in (("audio_bos_token", "<|audio_start|>"), ("audio_token", pad),
                                                          ("audio_eos_token", "<|audio_end|>")))
        return cls(audio, reserved)


FAMILY = Qwen3ASRFamily
