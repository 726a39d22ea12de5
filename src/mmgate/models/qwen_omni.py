"""The Qwen Omni family: Qwen2.5-Omni and Qwen3-Omni (thinker) images, videos and audio.

Stage: plan / preprocess / expand for ``model_type`` ``qwen2_5_omni`` and ``qwen3_omni_moe``.
Settings live under ``config.json`` ``thinker_config`` (token ids, ``audio_config``); the
processor files are the top-level ``preprocessor_config.json`` (one file for the image
processor and the feature extractor).

Reference (transformers 5.24):

* ``models/qwen2_5_omni/processing_qwen2_5_omni.py`` ``Qwen2_5OmniProcessor`` and
  ``models/qwen3_omni_moe/processing_qwen3_omni_moe.py`` ``Qwen3OmniMoeProcessor``
  (``OmniModalProcessorMixin.__call__``).  Both bundles build ``Qwen2VLImageProcessor``
  (Qwen2.5-Omni: patch 14, CLIP mean/std; Qwen3-Omni: patch 16, mean/std 0.5, the Qwen3-VL
  patch with the Qwen2-VL ``smart_resize``), ``Qwen2VLVideoProcessor`` and
  ``WhisperFeatureExtractor`` (checked by ``AutoProcessor.from_pretrained`` on both bundles).
  Images: :class:`~mmgate.models.qwen_vl.QwenVLImage` with Omni's image token
  (``<|IMAGE|>`` 151655 in Qwen2.5-Omni, ``<|image_pad|>`` 151655 in Qwen3-Omni):
  ``replace_image_token`` repeats it ``grid_t*grid_h*grid_w // merge**2`` times.
* Audio: ``_process_audio`` calls the feature extractor with the processor's ``audio_kwargs``
  (Qwen2.5-Omni forces ``padding="max_length"``: the clip is zero-padded and truncated to
  ``n_samples``; Qwen3-Omni ``padding=True, truncation=False``) and ``replace_audio_token``
  repeats the audio token ``N`` times, ``N`` = ``_get_feat_extract_output_lengths(mask.sum(-1))``
  (:func:`~mmgate.models.audio_features.qwen2_5_omni_audio_tokens`,
  :func:`~mmgate.models.audio_features.qwen3_omni_audio_tokens` with ``n_window`` 50, the
  processor's class attribute).  The audio start/end tokens come from the chat template
  (``<|audio_bos|><|AUDIO|><|audio_eos|>``, ``<|audio_start|><|audio_pad|><|audio_end|>``), so
  the prompt update is the pad run alone and the placeholder range covers it (smg
  ``PromptReplacement::repeated``; vLLM ``Qwen2_5OmniThinkerMultiModalProcessor``).

Audio wire layout: ``input_features`` batched, each clip's share its own valid frames
``[mel, valid_frames]``; :func:`mmgate.models.family.assemble` zero-pads the batch to
``[N, mel, max_frames]``, ``feature_attention_mask`` ``[N, max_frames]`` (1 on a clip's valid
frames, 0 on the padding: transformers' batch mask) and ``audio_feature_lengths`` ``[N]``, all
batched, int64 side tensors -- so an item's TokenSpeed share (``tensor[i:i+1]``) is smg's
``[1, mel, max_frames]`` + mask ``[1, max_frames]`` + lengths ``[1]`` (smg ``registry/qwen3_omni.rs``
``encoder_field_layouts_for(Audio)``: all three ``FieldLayout::Batched``), which TokenSpeed's
``qwen3_audio.pack_qwen3_audio_features`` trims to the lengths.  A clip's features are the reference's
for the request's whole audio batch (:class:`~mmgate.models.family.BatchPlanner`): Qwen3-Omni's
``padding=True`` zero-pads the shorter clips to the longest, which changes their last frames and gives
them ``ceil(n / hop)`` valid frames (:func:`~mmgate.models.audio_features.log_mel_features` with
``batch_longest``); ``--no-audio-batch-padding`` computes each clip alone instead (docs/parity.md "Audio").

Video: :mod:`mmgate.models.qwen_omni_video`.  ``mm_processor_kwargs`` ``use_audio_in_video`` (a bool;
``false``, the reference's default and what smg sends): with ``true`` each clip's audio track becomes an
audio item of this family (a companion of the clip, :mod:`mmgate.pipeline.companions`) and the clip's run
interleaves video and audio pad tokens as the processor's ``replace_video_with_audio_token``; a request without
video is unaffected (the processor loads tracks only when there are videos).

Limits per request: image 10, audio 10 (smg ``registry/qwen3_omni.rs`` ``modality_limits``; smg
has no Qwen2.5-Omni spec, the same numbers are used for it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.audio_features import (
    WhisperMelParams,
    log_mel_features,
    longest_in_batch,
    qwen2_5_omni_audio_tokens,
    qwen3_omni_audio_tokens,
)
from mmgate.models.backend import FrameSampling, ImageBackend
from mmgate.models.bundle import ModelBundle
from mmgate.models.family import MediaProcessor, processor_map
from mmgate.models.processor_options import check_option_types
from mmgate.models.qwen_omni_video import AudioTrack, OmniVideo
from mmgate.models.qwen_vl import QwenVLImage, image_params_from_config
from mmgate.types import DecodedAudio, ItemHints, ItemPlan, Modality, Replacement, TensorLayout, TensorSpec

#: per model type: (image token, audio token, audio start, audio end, video token, whether the extractor
#: pads to ``n_samples``, the token-count formula)
_TOKENS: dict[str, tuple[str, str, str, str, str]] = {
    "qwen2_5_omni": ("<|IMAGE|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|VIDEO|>"),
    "qwen3_omni_moe": ("<|image_pad|>", "<|audio_pad|>", "<|audio_start|>", "<|audio_end|>", "<|video_pad|>"),
}
#: ``Qwen2_5OmniProcessor._process_audio`` forces ``padding="max_length"``; ``Qwen3OmniMoeProcessor`` pads to
#: the longest of the batch (a clip alone: not at all)
_PAD_TO_MAX: dict[str, bool] = {"qwen2_5_omni": True, "qwen3_omni_moe": False}
#: ``Qwen3OmniMoeProcessor.n_window`` (5.24 class attribute; the model's ``audio_config.n_window`` is 50 too)
_QWEN3_N_WINDOW = 50
#: the request options the Omni processors take here
OPTION_TYPES: dict[str, tuple[type, ...]] = {"use_audio_in_video": (bool,)}


def check_omni_options(hints: ItemHints, model_type: str) -> None:
    """``mm_processor_kwargs``: only ``use_audio_in_video``, a bool.

    Raises:
        GatewayError(INVALID_REQUEST): another name or a non-bool, ``param`` ``mm_processor_kwargs.<name>``.
    """
    check_option_types(hints, OPTION_TYPES, model_type)


class OmniImage(QwenVLImage):
    """Qwen-VL images with Omni's token and Omni's request options (:func:`check_omni_options`)."""

    def check_hints(self, hints: ItemHints, param: str) -> None:
        """Raises GatewayError(INVALID_REQUEST): ``max_long_side_pixel`` off the resize factor; options
        other than a bool ``use_audio_in_video``."""
        if hints.max_long_side_pixel is not None and hints.max_long_side_pixel % self.params.factor:
            raise GatewayError(ErrorCode.INVALID_REQUEST,
                               f"max_long_side_pixel must be a positive multiple of {self.params.factor}",
                               param + ".max_long_side_pixel")
        check_omni_options(hints, self.model_type)


#: the audio tensors (module docstring): valid frames per clip, zero-padded in the batch; mask and lengths int64
AUDIO_SPECS = (
    TensorSpec("input_features", "float32", TensorLayout.BATCHED, primary=True),
    TensorSpec("feature_attention_mask", "int64", TensorLayout.BATCHED),
    TensorSpec("audio_feature_lengths", "int64", TensorLayout.BATCHED),
)


class OmniAudio:
    """Whisper log-mel features of one clip, and its pad run (module docstring).

    Implements :class:`~mmgate.models.family.AudioProcessor` and
    :class:`~mmgate.models.family.BatchPlanner` (the length a request's clips are padded to; it changes nothing
    for Qwen2.5-Omni, whose extractor pads every clip to ``n_samples``).  ``detail`` of a plan:
    ``(valid_frames, num_samples, batch_longest)``, the last 0 for a clip planned alone.
    """

    modality = Modality.AUDIO
    device_normalizable = False  # the features are computed here, never on a worker's device
    specs: tuple[TensorSpec, ...] = AUDIO_SPECS

    def __init__(self, model_type: str, params: WhisperMelParams, audio_token_id: int,
                 num_tokens: Callable[[int], int]) -> None:
        self.model_type = model_type
        self.params = params
        self.audio_token_id = audio_token_id
        self.sampling_rate = params.sampling_rate
        self._num_tokens = num_tokens

    @property
    def anchor_token_id(self) -> int:
        return self.audio_token_id

    @property
    def placeholder_token_id(self) -> int:
        return self.audio_token_id

    @property
    def fingerprint(self) -> str:
        return f"qwen_omni_audio:{self.model_type}:{self.params!r}"

    def check_hints(self, hints: ItemHints, param: str) -> None:
        """Raises GatewayError(INVALID_REQUEST): options other than a bool ``use_audio_in_video``."""
        check_omni_options(hints, self.model_type)

    def plan(self, audio: DecodedAudio, hints: ItemHints) -> ItemPlan:
        """Valid frames (the reference mask's sum) and the token count of one clip, processed alone.

        Raises:
            GatewayError(AUDIO_TOO_SHORT): fewer samples than the reference can frame.
        """
        return self.plan_in_batch(audio, hints, 0)

    def batch_context(self, items: Sequence[DecodedAudio]) -> int:
        """The length the reference's one extractor call pads the request's clips to
        (:func:`~mmgate.models.audio_features.longest_in_batch`)."""
        return longest_in_batch(self.params, [a.num_samples for a in items])

    def plan_in_batch(self, audio: DecodedAudio, hints: ItemHints, context: int) -> ItemPlan:
        """:meth:`plan` of a clip in a batch padded to ``context`` samples (0: alone).

        Raises:
            GatewayError(AUDIO_TOO_SHORT): a clip the reference cannot frame, or one that gives no audio token.
        """
        n = audio.num_samples
        if self.params.too_short(n, context):
            raise GatewayError(ErrorCode.AUDIO_TOO_SHORT,
                               f"audio is too short: {n} samples at {self.params.sampling_rate} Hz, the model needs "
                               f"at least {self.params.min_samples}")
        frames = self.params.valid_frames(n, context)
        tokens = self._num_tokens(frames)
        if tokens < 1:
            raise GatewayError(ErrorCode.AUDIO_TOO_SHORT, "audio is too short to give one audio token")
        mel = self.params.feature_size
        return ItemPlan(modality=Modality.AUDIO, original_hw=(0, 0), resized_hw=(0, 0), num_tokens=tokens,
                        shapes=(("input_features", (mel, frames)), ("feature_attention_mask", (frames,)),
                                ("audio_feature_lengths", ())),
                        detail=(frames, n, context))

    def batch_fingerprint(self, plan: ItemPlan) -> str:
        """``""`` for a clip whose features the batch leaves as alone, else the buffer it is framed in
        (:meth:`~mmgate.models.audio_features.WhisperMelParams.batch_key`)."""
        key = self.params.batch_key(plan.detail[1], plan.detail[2])
        return f"batch={key}" if key else ""

    def plan_tensors(self, plan: ItemPlan) -> dict[str, np.ndarray]:
        """``feature_attention_mask`` (ones over the valid frames) and ``audio_feature_lengths``, int64."""
        frames = plan.detail[0]
        return {"feature_attention_mask": np.ones(frames, dtype=np.int64),
                "audio_feature_lengths": np.array(frames, dtype=np.int64)}

    def preprocess(self, audio: DecodedAudio, plan: ItemPlan, raw: bool = False) -> np.ndarray:
        """``input_features`` of the clip's valid frames, float32 ``[mel, valid_frames]``."""
        return log_mel_features(audio.samples, self.params, batch_longest=plan.detail[2]).input_features

    def expand(self, plan: ItemPlan) -> Replacement:
        """The pad run replacing the template's one audio token."""
        return Replacement(token_ids=(self.audio_token_id,) * plan.num_tokens, embed_offset=0,
                           embed_length=plan.num_tokens)


def _thinker(bundle: ModelBundle) -> Mapping[str, Any]:
    thinker = bundle.config.get("thinker_config")
    return thinker if isinstance(thinker, dict) else bundle.config


def _check_id(bundle: ModelBundle, tokenizer: BundleTokenizer, token: str, *keys: str) -> int:
    """The id of ``token``, checked against ``thinker_config[key]`` (the first key present)."""
    token_id = tokenizer.token_id(token)
    if token_id is None:
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: no {token} token")
    thinker = _thinker(bundle)
    for key in keys:
        if thinker.get(key) is not None:
            if int(thinker[key]) != token_id:
                raise GatewayError(ErrorCode.INTERNAL_ERROR, f"bundle {bundle.name!r}: {token} id disagrees with {key}")
            break
    return token_id


class QwenOmniFamily:
    """Qwen2.5-Omni / Qwen3-Omni thinker: images, videos and audio (module docstring)."""

    model_types = ("qwen2_5_omni", "qwen3_omni_moe")
    limits: Mapping[Modality, int] = {Modality.IMAGE: 10, Modality.AUDIO: 10}
    #: the thinkers position media with M-RoPE (transformers 5.24 ``Qwen2_5OmniThinkerForConditionalGeneration``
    #: / ``Qwen3OmniMoeThinker...`` ``get_rope_index``): engines need the grids with the tokens
    mrope = True
    vllm_video_ids = False
    text_updates: frozenset[Modality] = frozenset()

    def __init__(self, model_type: str, image: OmniImage, audio: OmniAudio, reserved: tuple[str, ...],
                 video: OmniVideo | None = None) -> None:
        self.model_type = model_type
        self.image = image
        self.audio = audio
        self.video = video
        self._reserved = reserved
        self.processors: Mapping[Modality, MediaProcessor] = processor_map(image, video, audio)
        if video is not None:
            self.limits = {**QwenOmniFamily.limits, Modality.VIDEO: 1}

    @classmethod
    def from_bundle(cls, bundle: ModelBundle, tokenizer: BundleTokenizer, backend: ImageBackend,
                    video_backend: ImageBackend | None = None,
                    video_sampling: FrameSampling = FrameSampling.VLLM) -> QwenOmniFamily:
        """Read the image processor and feature extractor settings (``preprocessor_config.json``) and the
        token ids (checked against ``thinker_config``); ``backend`` must be resolved."""
        model_type = bundle.model_type
        image_token, audio_token, audio_start, audio_end, video_token = _TOKENS[model_type]
        cfg = bundle.preprocessor_config or dict(bundle.processor_config.get("feature_extractor") or {})
        image_id = _check_id(bundle, tokenizer, image_token, "image_token_id", "image_token_index")
        audio_id = _check_id(bundle, tokenizer, audio_token, "audio_token_id", "audio_token_index")
        start_id = _check_id(bundle, tokenizer, audio_start, "audio_start_token_id")
        end_id = _check_id(bundle, tokenizer, audio_end, "audio_end_token_id")
        image = OmniImage(model_type, image_params_from_config(cfg), image_id, backend)
        params = WhisperMelParams.from_config(cfg, pad_to_max_length=_PAD_TO_MAX[model_type])
        tokens: Callable[[int], int] = (qwen2_5_omni_audio_tokens if model_type == "qwen2_5_omni"
                                        else lambda frames: qwen3_omni_audio_tokens(frames, _QWEN3_N_WINDOW))
        audio = OmniAudio(model_type, params, audio_id, tokens)
        vision = ("<|vision_start|>", "<|vision_end|>") if model_type == "qwen3_omni_moe" else (
            "<|vision_bos|>", "<|vision_eos|>")
        reserved = (image_token, audio_token, audio_start, audio_end, video_token, *vision)
        track = AudioTrack(params.sampling_rate, start_id, audio_id, end_id)
        video = cls._video(bundle, tokenizer, video_token, vision, video_backend, video_sampling, track)
        return cls(model_type, image, audio, reserved, video)

    @staticmethod
    def _video(bundle: ModelBundle, tokenizer: BundleTokenizer, video_token: str, vision: tuple[str, str],
               backend: ImageBackend | None, sampling: FrameSampling, track: AudioTrack) -> OmniVideo | None:
        """The clip processor (:mod:`mmgate.models.qwen_omni_video`); None without PyAV."""
        from mmgate.media.video import av_available
        from mmgate.models import geometry
        from mmgate.models.qwen_vl_frames import video_config

        if not av_available():
            return None
        video_id = _check_id(bundle, tokenizer, video_token, "video_token_id", "video_token_index")
        ids = {"<|video_pad|>": video_id,
               "<|vision_start|>": _check_id(bundle, tokenizer, vision[0], "vision_start_token_id"),
               "<|vision_end|>": _check_id(bundle, tokenizer, vision[1], "vision_end_token_id")}
        cfg = video_config(bundle.processor_config, bundle.video_preprocessor_config, bundle.preprocessor_config)

        def encode(text: str) -> list[int]:
            return list(tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)

        return OmniVideo(bundle.model_type, cfg, ids, encode, backend or geometry.resolve_backend(ImageBackend.AUTO),
                         sampling, check_omni_options, track)

    @property
    def fingerprint(self) -> str:
        video = f"|{self.video.fingerprint}" if self.video is not None else ""
        return f"{self.image.fingerprint}|{self.audio.fingerprint}{video}"

    @property
    def reserved_tokens(self) -> tuple[str, ...]:
        """Media tokens caller text may never produce (:mod:`mmgate.chat.integrity`)."""
        return self._reserved


FAMILY = QwenOmniFamily
