"""Read a TokenSpeed ``GenerateRequest`` / ``EncodeRequest`` as the SMG servicer reads it.

Stage: engine request intake (TokenSpeed wire).  In: ``tokenspeed_scheduler.proto`` messages;
out: per-item :class:`Item` values, the request's :class:`~mmgate.refengine.mm_inputs.MediaBatch`
per modality (:func:`item_batches`), its sampling fields in the engine's sampling schema
(:func:`sampling_params`), its PD / EPD bootstrap (:func:`kv_bootstrap`, :func:`encode_sources`).

Mirrors smg-grpc-servicer 0.14.1 ``smg_grpc_servicer/tokenspeed/servicer.py``:
  * ``_build_generate_req``: ``tokenized`` required, ``input_ids`` not empty; ``mm_inputs`` read
    whenever present (an EPD prefill's items have no ``encoder_input``); ``encode_bootstrap_info``
    entries attached to ``mm_items[item_index]`` (out of range: ``ValueError``); ``kv_bootstrap_info``
    host / port / room for both PD legs;
  * ``_mm_inputs_from_itemized_proto``: one item per ``MultimodalItem``; ``_modality_from_proto``
    (IMAGE, VIDEO, AUDIO, else ``ValueError``; the encoder servicer's ``_items_from_proto`` reads
    UNSPECIFIED as IMAGE); ``encoder_input`` cast to the model dtype when floating
    (``_feature_from_proto``), side tensors kept at their wire dtype (``_tensor_from_proto``, read
    through ``mm_shm.tensor_payload_bytes``: inline or a ``/dev/shm`` segment, unlinked after the
    read); ``_validate_item_tensor_consistency``; ``placeholders`` required, each ``length > 0``;
    ``_merge_placeholder_token_id`` (conflicting ids per modality refused);
  * ``_sampling_params_from_proto``: optional scalars only when set; ``sampling_seed`` -> seed.

AUDIO items (TokenSpeed ``runtime/models/qwen3_audio.py`` ``pack_qwen3_audio_features``,
``_one_item_feature_length``): ``encoder_input`` is one clip's log-mel ``[num_mel_bins, frames]`` (a
leading singleton batch dimension accepted: smg sends ``[1, mel, max_frames_of_the_request]``); the
clip's valid length is ``model_specific_tensors["audio_feature_lengths"]`` (one value) when sent, else
``feature_attention_mask`` (``[frames]`` or ``[1, frames]``, right-padded contiguous ones), else every
frame; 1 <= length <= frames.  The item keeps its valid frames only, ``[1, mel, length]``, and a
``feature_attention_mask`` of ones ``[1, length]``; the lengths tensor has done its work and is dropped
(no transformers processor hands it to the model).  Concatenated as below, the clips become the
processor's batch: features zero-padded to the longest clip, the mask 0 on the padding.

The engine then does what TokenSpeed's model code does with the items: each tensor of one
modality's items concatenated on dim 0 in prompt order (every mmgate family's tensors are
batched or flat, so this is the batch a vLLM request carries; a batched tensor whose items
differ in shape is zero-padded to the largest, as transformers ``_pad_for_batching``), the
encoder input under the modality's forward kwarg (``pixel_values`` / ``pixel_values_videos``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from smg_grpc_proto.generated import (
    common_pb2,
    tokenspeed_scheduler_pb2,
    vllm_engine_pb2,
)

from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.device_normalize import DeviceNormalizer
from mmgate.refengine.mm_inputs import AUDIO_LENGTHS, AUDIO_MASK, MediaBatch, encoder_input_kwarg, finish_tensors
from mmgate.refengine.tensors import decode_tensor
from mmgate.types import Modality

_MODALITY = {common_pb2.IMAGE: Modality.IMAGE, common_pb2.VIDEO: Modality.VIDEO, common_pb2.AUDIO: Modality.AUDIO}


def _invalid(message: str) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message)


@dataclass(frozen=True, slots=True)
class Item:
    """One ``MultimodalItem``, read."""

    modality: Modality
    tensors: dict[str, torch.Tensor]  # forward-kwarg names; the encoder input under ``primary`` when sent
    primary: str
    placeholders: tuple[tuple[int, int], ...]  # (offset, length) embedding runs
    placeholder_token_id: int | None
    content_hash: bytes

    @property
    def embedding_rows(self) -> int:
        return sum(length for _, length in self.placeholders)

    @property
    def has_encoder_input(self) -> bool:
        return self.primary in self.tensors

    def as_batch(self) -> MediaBatch:
        return MediaBatch(self.modality, dict(self.tensors), self.primary)


def _modality(value: int, unspecified_is_image: bool) -> Modality:
    if value == common_pb2.MODALITY_UNSPECIFIED and unspecified_is_image:
        return Modality.IMAGE
    if value not in _MODALITY:
        raise _invalid(f"Unsupported multimodal item modality: {value}")
    return _MODALITY[value]


def _check_side_tensors(modality: Modality, names: set[str]) -> None:
    """``_validate_item_tensor_consistency``."""
    image, video = "image_grid_thw" in names, "video_grid_thw" in names
    if modality is Modality.IMAGE and video:
        raise _invalid("IMAGE MultimodalItem must not carry video_grid_thw")
    if modality is Modality.VIDEO and image:
        raise _invalid("VIDEO MultimodalItem must not carry image_grid_thw")
    if modality is Modality.VIDEO and not video:
        raise _invalid("VIDEO MultimodalItem must carry video_grid_thw")
    if modality is Modality.AUDIO and (image or video):
        raise _invalid("AUDIO MultimodalItem must not carry image/video grid tensors")


def _audio_length(tensors: dict[str, torch.Tensor], frames: int) -> int:
    """``_one_item_feature_length``: lengths first, then the mask, else every frame."""
    lengths, mask = tensors.get(AUDIO_LENGTHS), tensors.get(AUDIO_MASK)
    if lengths is not None:
        if lengths.numel() != 1:
            raise _invalid(f"AUDIO item {AUDIO_LENGTHS} must hold one value, got shape {list(lengths.shape)}")
        length = int(lengths.reshape(-1)[0])
    elif mask is not None:
        if mask.ndim == 2 and mask.shape[0] == 1:
            mask = mask[0]
        if mask.ndim != 1 or mask.shape[0] != frames:
            raise _invalid(f"AUDIO item {AUDIO_MASK} has shape {list(tensors[AUDIO_MASK].shape)}; "
                           f"expected [{frames}] or [1, {frames}]")
        length = int(mask.bool().sum())
        if not bool(mask[:length].bool().all()):
            raise _invalid(f"AUDIO item {AUDIO_MASK} must be right-padded contiguous ones")
    else:
        length = frames
    if not 1 <= length <= frames:
        raise _invalid(f"AUDIO item feature length {length} is outside [1, {frames}]")
    return length


def _audio_item(tensors: dict[str, torch.Tensor], primary: str) -> None:
    """An AUDIO item's tensors in place: its valid frames ``[1, mel, length]`` and a ones mask
    ``[1, length]`` (see the module docstring).

    Raises:
        GatewayError(INVALID_REQUEST): features not ``[mel, frames]`` / ``[1, mel, frames]``, or
            side tensors that contradict them.
    """
    features = tensors.get(primary)
    if features is None:  # a decode leg's identity: nothing to feed
        return
    if features.ndim == 3 and features.shape[0] == 1:
        features = features[0]
    if features.ndim != 2 or 0 in features.shape:
        raise _invalid(f"AUDIO encoder_input has shape {list(tensors[primary].shape)}; "
                       "expected [num_mel_bins, frames] or [1, num_mel_bins, frames]")
    length = _audio_length(tensors, int(features.shape[1]))
    tensors.pop(AUDIO_LENGTHS, None)
    tensors[primary] = features[:, :length].unsqueeze(0).contiguous()
    tensors[AUDIO_MASK] = torch.ones((1, length), dtype=torch.int64)


def read_items(mm_inputs: tokenspeed_scheduler_pb2.MultimodalInputs, normalizer: DeviceNormalizer | None = None,
               unspecified_is_image: bool = False) -> list[Item]:
    """The request's items in wire (prompt) order.

    Raises:
        GatewayError(INVALID_REQUEST): see the module docstring.
    """
    items: list[Item] = []
    token_ids: dict[Modality, int] = {}
    for proto in mm_inputs.items:
        modality = _modality(proto.modality, unspecified_is_image)
        primary = encoder_input_kwarg(modality)
        tensors = {name: decode_tensor(td) for name, td in proto.model_specific_tensors.items()}
        _check_side_tensors(modality, set(tensors))
        if proto.HasField("encoder_input"):
            if proto.encoder_input.WhichOneof("payload") == "remote":
                raise _invalid("TensorData.remote payload is not implemented by this engine")
            tensors[primary] = decode_tensor(proto.encoder_input)
        if modality is Modality.AUDIO:
            _audio_item(tensors, primary)
        finish_tensors(tensors, primary, normalizer)
        if not proto.placeholders:
            raise _invalid("MultimodalItem carried no placeholders")
        if any(p.length <= 0 for p in proto.placeholders):
            raise _invalid("MultimodalItem.placeholders.length must be > 0")
        token_id = int(proto.placeholder_token_id) if proto.HasField("placeholder_token_id") else None
        if token_id is not None and token_ids.setdefault(modality, token_id) != token_id:
            raise _invalid(f"Conflicting placeholder_token_id for {modality.name}: "
                           f"{token_ids[modality]} != {token_id}")
        items.append(Item(modality, tensors, primary, tuple((p.offset, p.length) for p in proto.placeholders),
                          token_id, bytes(proto.content_hash)))
    if mm_inputs.items and not items:
        raise _invalid("MultimodalInputs.items is empty")
    return items


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Items' shares of one tensor on dim 0; trailing dims zero-padded to the largest."""
    if len({tuple(p.shape[1:]) for p in parts}) > 1:
        if len({p.ndim for p in parts}) > 1:
            raise _invalid("items carry one tensor at different ranks")
        size = [max(p.shape[d] for p in parts) for d in range(1, parts[0].ndim)]
        padded = []
        for p in parts:
            out = p.new_zeros((p.shape[0], *size))
            out[tuple(slice(0, n) for n in p.shape)] = p
            padded.append(out)
        parts = padded
    return torch.cat(parts, dim=0)


def item_batches(items: list[Item], with_encoder_input: bool = True) -> list[MediaBatch]:
    """One :class:`MediaBatch` per modality (first appearance order), each tensor concatenated across
    the modality's items in prompt order; ``with_encoder_input`` False leaves the encoder inputs out.

    Raises:
        GatewayError(INVALID_REQUEST): items of one modality carrying different tensor names.
    """
    by_modality: dict[Modality, list[Item]] = {}
    for item in items:
        by_modality.setdefault(item.modality, []).append(item)
    batches = []
    for modality, group in by_modality.items():
        names = [set(i.tensors) - ({i.primary} if not with_encoder_input else set()) for i in group]
        if any(n != names[0] for n in names):
            raise _invalid(f"{modality.value} items carry different tensors: {sorted(map(sorted, names))}")
        tensors = {name: _concat([i.tensors[name] for i in group]) for name in sorted(names[0])}
        batches.append(MediaBatch(modality, tensors, group[0].primary))
    return batches


@dataclass(frozen=True, slots=True)
class EncodeSource:
    """Where one item's embeddings wait: ``EncodeItemBootstrapInfo``."""

    item_index: int
    host: str
    port: int
    room: int


def encode_sources(request: tokenspeed_scheduler_pb2.GenerateRequest, item_count: int) -> dict[int, EncodeSource]:
    """``encode_bootstrap_info`` by item index (empty when absent).

    Raises:
        GatewayError(INVALID_REQUEST): bootstrap info without ``mm_inputs``, or an index out of range.
    """
    if not request.HasField("encode_bootstrap_info"):
        return {}
    if not request.HasField("mm_inputs"):
        raise _invalid("GenerateRequest.encode_bootstrap_info present but mm_inputs is missing; "
                       "bootstrap info describes items that must be in mm_inputs")
    out = {}
    for h in request.encode_bootstrap_info.items:
        if not 0 <= h.item_index < item_count:
            raise _invalid(f"EPD encode bootstrap item_index {h.item_index} out of range for {item_count} mm item(s)")
        out[int(h.item_index)] = EncodeSource(int(h.item_index), h.bootstrap_host, int(h.bootstrap_port),
                                              int(h.bootstrap_room))
    return out


def kv_bootstrap(request: tokenspeed_scheduler_pb2.GenerateRequest) -> tuple[str, int, int] | None:
    """``kv_bootstrap_info`` as (host, port, room), None when absent."""
    if not request.HasField("kv_bootstrap_info"):
        return None
    info = request.kv_bootstrap_info
    return info.bootstrap_host, int(info.bootstrap_port), int(info.bootstrap_room)


_OPTIONAL = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
             "repetition_penalty")


def sampling_params(request: tokenspeed_scheduler_pb2.GenerateRequest) -> vllm_engine_pb2.SamplingParams:
    """The request's sampling fields in the engine's schema (vLLM's ``SamplingParams``, which
    :func:`mmgate.refengine.sampling.plan_generation` reads).

    ``_sampling_params_from_proto``: each optional scalar only when set (an unset temperature is
    the engine's default: greedy here); ``top_k`` -1 (TokenSpeed's "disabled") is 0;
    ``sampling_seed`` -> seed; ``no_stop_trim`` keeps a matched stop string
    (``include_stop_str_in_output``); ``ebnf_grammar`` -> grammar; logprobs from
    ``return_logprob`` / ``top_logprobs_num``.
    """
    p = request.sampling_params
    out = vllm_engine_pb2.SamplingParams(
        min_tokens=p.min_new_tokens, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens, n=p.n or 1,
        include_stop_str_in_output=p.no_stop_trim)
    for name in _OPTIONAL:
        if p.HasField(name):
            value = getattr(p, name)
            if name == "max_new_tokens":
                out.max_tokens = value
            elif name == "top_k":
                out.top_k = max(value, 0)
            else:
                setattr(out, name, value)
    if p.HasField("sampling_seed"):
        if p.sampling_seed >= 2**31:
            raise _invalid("sampling_seed must be below 2**31 on the reference engine")
        out.seed = p.sampling_seed
    try:
        out.logit_bias.update({int(k): v for k, v in p.logit_bias.items()})
    except ValueError:
        raise _invalid("logit_bias keys must be token ids") from None
    which = p.WhichOneof("constraint")
    if which == "ebnf_grammar":
        out.grammar = p.ebnf_grammar
    elif which is not None:
        setattr(out, which, getattr(p, which))
    if request.return_logprob:
        out.logprobs = max(request.top_logprobs_num, 0)
    return out
