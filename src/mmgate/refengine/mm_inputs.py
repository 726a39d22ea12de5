"""Turn a request's prompt and multimodal tensors into model inputs: one generic path for every wire.

Stage: engine request intake.  In: the expanded prompt ids (one placeholder token per embedding
row) and one :class:`MediaBatch` per modality: neutral tensors under the model's forward-kwarg
names, read from the wire by its servicer (vLLM: :func:`vllm_batches` here; SGLang:
:mod:`.sglang_servicer`; TokenSpeed's per-item tensors, concatenated: :mod:`.tokenspeed_inputs`);
optionally the encode leg's embeddings (``mm_encoder_outputs``, :mod:`.encoding`).  Out:
:class:`ModelInputs` with ``input_ids`` ``[1, seq]`` int64 and the keyword tensors the model's
``forward`` takes (:func:`assemble_inputs`).  The model code is the same for every wire and role.

vLLM wire (``GenerateRequest``: ``mm_inputs`` and ``extra_mm_inputs``, one ``MultimodalInputs``
batch per modality):

Mirrors ``smg_grpc_servicer/vllm/servicer.py`` ``_build_preprocessed_mm_inputs``
and ``mm_keys.py`` (smg-grpc-servicer 0.14.1): the primary tensor travels in
``pixel_values`` under the key ``encoder_input_key`` (default
``pixel_values``), renamed ``pixel_values_videos`` for a VIDEO batch;
``model_specific_tensors`` keep their names; floating tensors are cast to the
model dtype (float32).  Two batches carrying the same key are refused.

Nothing here is per family except the token-type tensor: every tensor is
passed under its wire name when the model's ``forward`` names it, and the
transformers model takes the vLLM layouts as they arrive:
  * Qwen-VL: ``pixel_values`` flat ``[sum(patches), C*T*P*P]`` + ``image_grid_thw``;
  * LLaVA-1.5: ``pixel_values`` batched ``[N, 3, 336, 336]``;
  * LLaVA-NeXT: ``pixel_values`` batched ``[N, tiles, 3, 336, 336]`` (zero-padded to
    the most tiles) + ``image_sizes`` ``[N, 2]``;
  * Gemma 3: ``pixel_values`` flat ``[sum(1 + crops), 3, 896, 896]`` (pan-and-scan
    crops are more images to its tower).
Bookkeeping tensors the forward does not take (Qwen's ``patches_per_image``,
Gemma 3's ``num_patches``: the ``flat_keys`` sizes) are checked for consistency
and then dropped.  A primary tensor the model cannot take is refused, never
dropped.  The token-type tensor the family's row names
(:class:`~mmgate.refengine.families.TokenTypes`: Qwen-VL ``mm_token_type_ids``,
Gemma 3 ``token_type_ids``) is built from the prompt's placeholder ids, as the
model's processor builds it.  Positions are the model's own: M-RoPE models
compute them (and ``rope_deltas``) from ``input_ids`` and the grids, the
others count 0..seq-1.  No placeholder count is checked here: the model's own
code (``get_placeholder_mask``) is the authority on token/feature agreement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2

from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.bundle import LazyTokenizer, LoadedModel
from mmgate.refengine.device_normalize import DeviceNormalizer
from mmgate.refengine.families import MM_TOKEN_TYPES, TokenTypes
from mmgate.refengine.tensors import decode_tensor, require_shape
from mmgate.types import Modality

DEFAULT_ENCODER_INPUT_KEY = "pixel_values"
VIDEO_ENCODER_INPUT_KEY = "pixel_values_videos"
#: the forward kwarg of an audio encoder input (Whisper-style towers) when a wire names none
AUDIO_ENCODER_INPUT_KEY = "input_features"
#: TokenSpeed's (and smg's) names of an AUDIO item's side tensors (smg ``qwen3_omni.rs`` / ``qwen3_asr.rs``
#: ``encoder_field_layouts_for(Modality::Audio)``; TokenSpeed ``qwen3_audio.py`` reads them); an audio
#: :class:`MediaBatch` carries its per-frame mask under ``AUDIO_MASK``
AUDIO_MASK = "feature_attention_mask"
AUDIO_LENGTHS = "audio_feature_lengths"


@dataclass(frozen=True, slots=True)
class MediaBatch:
    """One modality's tensors as any wire delivers them, under the model's forward-kwarg names.

    ``primary`` is the encoder input's kwarg (``pixel_values`` / ``pixel_values_videos``); it is
    absent from ``tensors`` when the leg carries no encoder input (an EPD prefill, whose embeddings
    come from the encode leg, or a decode leg).  Floating tensors are float32.
    """

    modality: Modality
    tensors: dict[str, torch.Tensor]
    primary: str


@dataclass(frozen=True, slots=True)
class ModelInputs:
    """One request's model inputs (batch size 1)."""

    input_ids: torch.Tensor  # [1, seq] int64
    attention_mask: torch.Tensor  # [1, seq] int64, all ones
    mm_kwargs: dict[str, torch.Tensor]  # forward kwargs: pixel_values, image_grid_thw, mm_token_type_ids, ...
    dropped_keys: tuple[str, ...]  # received tensors the model's forward does not take
    # modality ("image" | "video") -> the encode leg's output, passed as the forward's ``mm_encoder_outputs``
    encoder_outputs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # forward flags read from the prompt (:func:`audio_in_video`), passed with the prefill
    flags: Mapping[str, bool] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1])


def mm_batches(request: vllm_engine_pb2.GenerateRequest) -> list[vllm_engine_pb2.MultimodalInputs]:
    """``mm_inputs`` first, then ``extra_mm_inputs`` (``mm_keys.mm_batches``)."""
    batches = [request.mm_inputs] if request.HasField("mm_inputs") else []
    batches.extend(request.extra_mm_inputs)
    return batches


def modality_key(key: str, is_video: bool) -> str:
    """``mm_keys.modality_key``: video pixels go to ``pixel_values_videos``; other keys as-is."""
    if is_video and key == DEFAULT_ENCODER_INPUT_KEY:
        return VIDEO_ENCODER_INPUT_KEY
    return key


def encoder_input_kwarg(modality: Modality, key: str = DEFAULT_ENCODER_INPUT_KEY) -> str:
    """The forward kwarg of a ``modality`` batch's encoder input sent under ``key``."""
    if modality is Modality.AUDIO and key == DEFAULT_ENCODER_INPUT_KEY:
        return AUDIO_ENCODER_INPUT_KEY
    return modality_key(key, modality is Modality.VIDEO)


def finish_tensors(batch: dict[str, torch.Tensor], primary: str,
                   normalizer: DeviceNormalizer | None = None) -> dict[str, torch.Tensor]:
    """``batch`` ready for the model, in place: a uint8 encoder input normalized by ``normalizer``
    (an engine started with ``--mm-device-do-normalize``; any other engine refuses it), floats
    cast to float32, every ``*_grid_thw`` of rank 2.

    Raises:
        GatewayError(INVALID_REQUEST)
    """
    if primary in batch and batch[primary].dtype == torch.uint8:
        if normalizer is None:
            raise GatewayError(ErrorCode.INVALID_REQUEST,
                               "raw uint8 pixels sent to an engine that does not normalize on device")
        try:
            batch[primary] = normalizer.normalize(batch[primary])
        except ValueError as exc:
            raise GatewayError(ErrorCode.INVALID_REQUEST, str(exc)) from None
    for key, tensor in batch.items():
        if tensor.is_floating_point():
            batch[key] = tensor.to(torch.float32)
        if key.endswith("_grid_thw"):
            require_shape(key, tensor, 2)
    return batch


def _check_layout(mm: vllm_engine_pb2.MultimodalInputs, batch: dict[str, torch.Tensor], is_video: bool) -> None:
    """Refuse a batch whose layout metadata contradicts its tensors.

    ``flat_keys`` {tensor: sizes}: ``tensor.shape[0] == sizes.sum()``;
    ``batched_keys``: first dimension == number of placeholders (when given).

    Raises:
        GatewayError(INVALID_REQUEST)
    """
    for key, sizes_key in mm.flat_keys.items():
        tensor, sizes = batch.get(modality_key(key, is_video)), batch.get(modality_key(sizes_key, is_video))
        if tensor is None or sizes is None:
            continue
        total = int(sizes.sum())
        if tensor.ndim == 0 or tensor.shape[0] != total:
            raise GatewayError(
                ErrorCode.INVALID_REQUEST,
                f"tensor {key!r} has {tensor.shape[0] if tensor.ndim else 0} rows; "
                f"its sizes {sizes_key!r} sum to {total}",
            )
    items = len(mm.mm_placeholders)
    for key in mm.batched_keys:
        tensor = batch.get(modality_key(key, is_video))
        if tensor is not None and items and (tensor.ndim == 0 or tensor.shape[0] != items):
            raise GatewayError(
                ErrorCode.INVALID_REQUEST,
                f"batched tensor {key!r} has shape {list(tensor.shape)}; the batch has {items} placeholders",
            )


def vllm_modality(mm: vllm_engine_pb2.MultimodalInputs) -> Modality:
    """``mm_keys.modality_name``: VIDEO is a video batch, anything else an image batch."""
    return Modality.VIDEO if mm.modality == common_pb2.VIDEO else Modality.IMAGE


def batch_tensors(mm: vllm_engine_pb2.MultimodalInputs,
                  normalizer: DeviceNormalizer | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of one vLLM batch under its forward-kwarg name, ready for the model (:func:`finish_tensors`).

    Raises:
        GatewayError(INVALID_REQUEST): a malformed tensor or contradictory layout.
    """
    is_video = mm.modality == common_pb2.VIDEO
    primary = modality_key(mm.encoder_input_key or DEFAULT_ENCODER_INPUT_KEY, is_video)
    batch: dict[str, torch.Tensor] = {}
    if mm.HasField("pixel_values"):
        batch[primary] = decode_tensor(mm.pixel_values)
    for key, td in mm.model_specific_tensors.items():
        batch[modality_key(key, is_video)] = decode_tensor(td)
    finish_tensors(batch, primary, normalizer)
    _check_layout(mm, batch, is_video)
    return batch


def refuse_audio_batches(request: vllm_engine_pb2.GenerateRequest) -> None:
    """Refuse a batch whose ``modality`` is AUDIO: the vLLM wire carries no preprocessed audio.

    smg-grpc-servicer 0.14.1 ``vllm/mm_keys.py`` ``modality_name`` (l. 57-59) names every non-video
    batch ``image``, so a real worker would hand log-mel features to the vision tower as pixels
    (``servicer.py`` l. 1108-1172 registers the batch, its hashes and placeholders under ``image``);
    the reference engine refuses the batch outright instead.  Audio reaches a vLLM worker as a media
    reference (``media_refs``, processed by the worker) only.

    Raises:
        GatewayError(MULTIMODAL_NOT_SUPPORTED)
    """
    if any(mm.modality == common_pb2.AUDIO for mm in mm_batches(request)):
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                           "the vLLM wire carries no preprocessed audio (the servicer reads every non-video "
                           "batch as image); send audio as a media reference to a worker that processes media")


def vllm_batches(request: vllm_engine_pb2.GenerateRequest,
                 normalizer: DeviceNormalizer | None = None) -> list[MediaBatch]:
    """The vLLM request's batches as :class:`MediaBatch` values, in wire order (a wire request's AUDIO
    batches are refused before this: :func:`refuse_audio_batches`)."""
    out = []
    for mm in mm_batches(request):
        is_video = mm.modality == common_pb2.VIDEO
        primary = modality_key(mm.encoder_input_key or DEFAULT_ENCODER_INPUT_KEY, is_video)
        out.append(MediaBatch(vllm_modality(mm), batch_tensors(mm, normalizer), primary))
    return out


def check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """``ids`` as a list, refused when empty or outside the vocabulary.

    Raises:
        GatewayError(INVALID_REQUEST)
    """
    ids = [int(i) for i in ids]
    if not ids:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "prompt is empty")
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"token id {bad} is outside the vocabulary ({vocab_size})")
    return ids


def prompt_ids(request: vllm_engine_pb2.GenerateRequest, tokenizer: LazyTokenizer, vocab_size: int) -> list[int]:
    """The prompt token ids: ``tokenized.input_ids``, or ``text`` run through the tokenizer.

    Raises:
        GatewayError(INVALID_REQUEST): no prompt, an empty prompt, or an id outside the vocabulary.
    """
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        ids = list(request.tokenized.input_ids)
    elif kind == "text":
        ids = list(tokenizer.get()(request.text, add_special_tokens=False)["input_ids"])
    else:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "request has neither tokenized input nor text")
    return check_ids(ids, vocab_size)


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int | None, video_token_id: int | None,
                      types: TokenTypes = MM_TOKEN_TYPES) -> torch.Tensor:
    """Per-token modality: 0 text, ``types.image`` on image placeholders, ``types.video`` on video ones;
    ``[1, seq]`` int64.

    Default values mirror transformers ``processing_utils.ProcessorMixin.create_mm_token_type_ids``
    (5.24: 1 image, 2 video), which Qwen-VL processors return next to ``input_ids`` and M-RoPE
    reads; ``Gemma3Processor.__call__`` (5.24) sets ``token_type_ids`` 1 on ``image_token_id``.
    """
    out = torch.zeros_like(input_ids)
    if image_token_id is not None and types.image is not None:
        out[input_ids == image_token_id] = types.image
    if video_token_id is not None and types.video is not None:
        out[input_ids == video_token_id] = types.video
    return out


def audio_kwargs(batch: MediaBatch, loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """An audio batch's tensors as the model's processor hands them to its forward.

    In: ``batch.tensors`` holds the clips' features ``[clips, mel, frames]`` (each clip's valid frames,
    zero-padded to the longest) and their per-frame mask ``[clips, frames]`` under the wire's name
    (:data:`AUDIO_MASK`).  Out: the features with the frame axis
    zero-padded to ``facts.audio_frame_multiple`` (Qwen3-ASR: ``Qwen3ASRFeatureExtractor`` pads to a
    multiple of ``2 * n_window``) and the mask, padded alike, under the row's ``mask_kwarg`` in its
    ``mask_dtype`` (transformers 5.24: ``Qwen2_5OmniProcessor`` / ``Qwen3OmniMoeProcessor``
    ``feature_attention_mask``, ``Qwen3ASRProcessor`` ``input_features_mask``, int32 from
    ``WhisperFeatureExtractor`` / ``Qwen3ASRFeatureExtractor``).  The processors' own padding beyond
    the longest clip (Qwen2.5-Omni pads every clip to ``n_samples``, 30000 frames) is not reproduced:
    ``get_audio_features`` drops every masked frame before the tower.

    Raises:
        GatewayError(MULTIMODAL_NOT_SUPPORTED): the model takes no audio.
        GatewayError(INVALID_REQUEST): features without a mask, or a mask of another frame count.
    """
    facts, spec = loaded.facts, loaded.family.audio
    if spec is None or not facts.supports_audio:
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, f"model {facts.model_type!r} takes no audio")
    tensors = dict(batch.tensors)
    features, mask = tensors.get(batch.primary), tensors.pop(AUDIO_MASK, None)
    if features is None:
        return tensors
    if mask is None or features.ndim != 3 or mask.shape != (features.shape[0], features.shape[2]):
        raise GatewayError(ErrorCode.INVALID_REQUEST,
                           f"audio features {list(features.shape)} need a [clips, frames] mask, "
                           f"got {None if mask is None else list(mask.shape)}")
    multiple = max(facts.audio_frame_multiple, 1)
    pad = -features.shape[2] % multiple
    if pad:
        features = torch.nn.functional.pad(features, (0, pad))
        mask = torch.nn.functional.pad(mask, (0, pad))
    tensors[batch.primary] = features.contiguous()
    tensors[spec.mask_kwarg] = mask.to(getattr(torch, spec.mask_dtype)).contiguous()
    return tensors


def audio_in_video(ids: Sequence[int], loaded: LoadedModel) -> dict[str, bool]:
    """``{in_video_kwarg: True}`` when a clip of the prompt carries its audio track interleaved: a vision start
    token right before an audio start token (the gateway's ``use_audio_in_video`` run, transformers 5.24
    ``Qwen2_5OmniProcessor.replace_video_with_audio_token`` under the template's vision start); else ``{}``.

    The Omni thinkers' ``get_rope_index`` takes the request's ``use_audio_in_video`` as an argument; the wires
    carry no such field, and the prompt says it: a clip without its track keeps its plain run."""
    spec = loaded.family.audio
    if spec is None or spec.in_video_kwarg is None or spec.in_video_kwarg not in loaded.forward_params:
        return {}
    config = loaded.model.config
    start, audio = getattr(config, "vision_start_token_id", None), getattr(config, "audio_start_token_id", None)
    if start is None or audio is None:
        return {}
    found = any(a == start and b == audio for a, b in zip(ids, ids[1:]))
    return {spec.in_video_kwarg: True} if found else {}


def assemble_inputs(ids: Sequence[int], batches: Sequence[MediaBatch], loaded: LoadedModel,
                    encoder_outputs: Mapping[str, Any] | None = None) -> ModelInputs:
    """The model inputs of a checked prompt and its media batches (every wire ends here).

    ``encoder_outputs``: modality name -> the encode leg's output for that modality's items
    (:func:`mmgate.refengine.encoding.combine`), replacing the batch's encoder input.

    Raises:
        GatewayError(INVALID_REQUEST): batches carrying the same key.
        GatewayError(MULTIMODAL_NOT_SUPPORTED): media for a text-only model, or an encoder input
            (or embeddings) the model's forward does not take.
    """
    facts = loaded.facts
    input_ids = torch.tensor([list(ids)], dtype=torch.int64)
    if (batches or encoder_outputs) and not facts.takes_media:
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, f"model {facts.model_type!r} takes no multimodal inputs")
    if encoder_outputs and "mm_encoder_outputs" not in loaded.forward_params:
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                           f"model {facts.model_type!r} takes no precomputed encoder outputs")
    tensors: dict[str, torch.Tensor] = {}
    for batch in batches:
        if batch.modality is Modality.AUDIO:
            batch = MediaBatch(batch.modality, audio_kwargs(batch, loaded), batch.primary)
        shared = batch.tensors.keys() & tensors.keys()
        if shared:
            raise GatewayError(
                ErrorCode.INVALID_REQUEST,
                f"multimodal batches carry the same tensor keys {sorted(shared)}; one batch per modality is expected",
            )
        if batch.primary in batch.tensors and batch.primary not in loaded.forward_params:
            raise GatewayError(
                ErrorCode.MULTIMODAL_NOT_SUPPORTED, f"model {facts.model_type!r} takes no {batch.primary!r} input"
            )
        tensors.update(batch.tensors)
    mm_kwargs = {k: v for k, v in tensors.items() if k in loaded.forward_params}
    dropped = tuple(sorted(k for k in tensors if k not in loaded.forward_params))
    types = loaded.family.token_types
    if types is not None and types.kwarg in loaded.forward_params and facts.supports_vision:
        mm_kwargs[types.kwarg] = mm_token_type_ids(input_ids, facts.image_token_id, facts.video_token_id, types)
    return ModelInputs(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_kwargs=mm_kwargs,
        dropped_keys=dropped,
        encoder_outputs=MappingProxyType(dict(encoder_outputs or {})),
        flags=MappingProxyType(audio_in_video(ids, loaded)),
    )


def build_model_inputs(
    request: vllm_engine_pb2.GenerateRequest, loaded: LoadedModel, tokenizer: LazyTokenizer,
    normalizer: DeviceNormalizer | None = None,
) -> ModelInputs:
    """Decode and check a vLLM-wire request into :class:`ModelInputs`.

    Raises:
        GatewayError(INVALID_REQUEST): malformed prompt or tensors, duplicate keys across batches.
        GatewayError(MULTIMODAL_NOT_SUPPORTED): media for a text-only model, worker-side
            media references, or a primary tensor the model's forward does not take.
    """
    if request.HasField("media_refs") and request.media_refs.items:
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, "this engine does not process media references")
    refuse_audio_batches(request)
    ids = prompt_ids(request, tokenizer, loaded.facts.vocab_size)
    if mm_batches(request) and not loaded.facts.supports_vision:
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                           f"model {loaded.facts.model_type!r} takes no multimodal inputs")
    return assemble_inputs(ids, vllm_batches(request, normalizer), loaded)
