"""TokenSpeed engine wire (``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` and
``tokenspeed.grpc.encoder.TokenSpeedEncoder`` of ``smg-grpc-proto``): the messages, nothing else.

Stage: assemble + transport.  In: a :class:`~mmgate.types.PreparedRequest` after worker
selection, the :class:`~mmgate.engines.base.Role` of the leg, the worker's
:class:`~mmgate.transport.policy.WirePlan`; out: the scheduler's ``GenerateRequest``
(:func:`build_generate_request`) or one encoder ``EncodeRequest`` per item
(:func:`build_encode_request`); the scheduler's ``GenerateResponse`` -> neutral events
(:func:`events`).  The client and the adapter seam live elsewhere.

Every field is filled as the real servicer reads it (smg-grpc-servicer 0.14.1,
``smg_grpc_servicer/tokenspeed/servicer.py`` ``_build_generate_req``,
``_sampling_params_from_proto``, ``_mm_inputs_from_itemized_proto``;
``tokenspeed/encoder_servicer.py`` ``Encode`` / ``_items_from_proto``) and as the Rust
gateway builds it (lightseekorg/smg ``model_gateway/src/routers/grpc/multimodal/assemble.rs``
``assemble_tokenspeed_with_options``, ``transport.rs``, ``proto_wrapper.rs``,
``common/stages/encode.rs``, ``request_execution.rs``); docs/engines-tokenspeed.md has
the field table.  Invariants:

* one ``MultimodalItem`` per media item, in prompt order across modalities, each with its
  own share of every tensor (batched: ``[1, ...]``; flat: its rows, by the sizes key;
  shared: the whole tensor) and its embedding runs as ``placeholders``;
* the encoder input goes only to the leg that runs the vision tower (single, prefill
  without encode workers, encode); the decode leg and an EPD prefill get items without it;
* the decode leg never carries a shared-memory handle (the prefill leg's engine unlinks
  what it reads); every other tensor goes through shm when ``WirePlan.use_shm`` says so
  and a lease is given, else inline (a failed segment falls back to inline, counted).

A :class:`~mmgate.types.PendingTensor` primary must be :func:`materialize`\\ d before a leg
that carries the encoder input is built: per-item slicing of a deferred tensor would need
one buffer per item and tensor, so this wire computes the values first and copies each
item's share once into its message or segment (the decode leg and an EPD prefill never
need the values).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import blake3
import numpy as np
from smg_grpc_proto.generated import (
    tokenspeed_encoder_pb2,
    tokenspeed_scheduler_pb2,
)

from mmgate.engines.base import Bootstrap, EngineEvent, Role
from mmgate.engines.responses import response_events
from mmgate.engines.wire_values import (
    INT32,
    INT63,
    PROTO_MODALITY,
    UINT32,
    UINT64,
    check_range,
    choice_grammar,
    embedding_runs,
    tensor_data,
)
from mmgate.errors import ErrorCode, GatewayError
from mmgate.transport.dtypes import convert_encoder_input
from mmgate.transport.placement import BufferTarget
from mmgate.transport.policy import INLINE_FLOAT32, WirePlan
from mmgate.transport.shm import ShmLease
from mmgate.types import (
    ConstraintKind,
    EncoderBatch,
    PendingTensor,
    PreparedRequest,
    SamplingParams,
    TensorLayout,
)

ENGINE = "tokenspeed"
_pb = tokenspeed_scheduler_pb2
#: ``embedding_runs`` whole_span_when_empty: True.  ``_mm_inputs_from_itemized_proto`` (l.1181-1185)
#: refuses an item without placeholders (or one of length 0); SMG sends the structural span when an
#: item has no patch run (``assemble.rs`` ``placeholders_for_binding`` with ``prefer_patches``)
SPAN_WHEN_NO_RUN = True


def _bug(message: str) -> GatewayError:
    return GatewayError(ErrorCode.INTERNAL_ERROR, message)


# --- items ------------------------------------------------------------------------------------------

def prompt_items(req: PreparedRequest) -> list[tuple[EncoderBatch, int]]:
    """(batch, index within the batch) of every media item, in prompt order across modalities.

    Items of one batch are already in prompt order; batches interleave, so the order is
    that of the placeholder offsets (SMG sorts by ``prompt_ordinal``, the same order).
    """
    if any(not b.placeholders for b in req.batches):
        raise _bug("an encoder batch without placeholder ranges")
    items = [(b, i) for b in req.batches for i in range(len(b.placeholders))]
    return sorted(items, key=lambda item: item[0].placeholders[item[1]].offset)


def item_share(batch: EncoderBatch, name: str, index: int) -> np.ndarray:
    """Item ``index``'s share of tensor ``name`` (SMG ``assemble.rs`` ``encoder_input_for_item`` /
    ``serialize_model_specific_for_item``): batched ``tensor[index:index + 1]``; flat the item's rows
    (offsets from the sizes tensor); shared the whole tensor (a key with no layout is sent whole)."""
    spec = next(s for s in batch.specs if s.name == name)
    tensor = batch.tensors[name]
    assert isinstance(tensor, np.ndarray), "a pending tensor is materialized first"
    if spec.layout is TensorLayout.BATCHED:
        return tensor[index:index + 1]
    if spec.layout is TensorLayout.SHARED:
        return tensor
    sizes = batch.tensors.get(spec.sizes_key or "")
    if not isinstance(sizes, np.ndarray):
        raise _bug(f"flat tensor {name} has no sizes tensor {spec.sizes_key!r} in its batch")
    counts = [int(n) for n in sizes.reshape(-1)]
    start = sum(counts[:index])
    return tensor[start:start + counts[index]]


def content_hash(mm_hash: str) -> bytes:
    """``MultimodalItem.content_hash``: blake3 of the item's hash text, as SMG builds it
    (``assemble.rs`` ``content_hash_for_item`` / ``hash_hex_strings``).  The servicer keys the
    item's pad value on its first 8 bytes (``int.from_bytes(content_hash[:8], "little")``)."""
    return blake3.blake3(mm_hash.encode()).digest()


def _tensor_data(array: np.ndarray, dtype_name: str, wire: WirePlan, lease: ShmLease | None,
                 name: str) -> tokenspeed_scheduler_pb2.TensorData:
    """``TensorData`` in shared memory (``lease`` given and ``wire.use_shm``) or inline.

    ``shape`` is ``repeated uint32``, ``dtype`` a name the servicer's ``_tensor_from_proto``
    reads (``bfloat16`` as uint16 bits, else ``np.dtype(name)``); ``shm`` a ``common.ShmHandle``
    read at ``offset`` 0 for ``nbytes`` by ``mm_shm.tensor_payload_bytes``.
    """
    return tensor_data(array, dtype_name, wire, lease, name, engine=ENGINE, message=_pb.TensorData)


def _item(req: PreparedRequest, batch: EncoderBatch, index: int, with_input: bool, wire: WirePlan,
          lease: ShmLease | None) -> tokenspeed_scheduler_pb2.MultimodalItem:
    """One ``MultimodalItem``; ``lease`` None keeps every tensor inline."""
    if len(batch.mm_hashes) != len(batch.placeholders):
        raise _bug(f"{batch.modality} batch has {len(batch.mm_hashes)} hashes for {len(batch.placeholders)} items")
    runs = embedding_runs(req.input_ids, batch.placeholder_token_id, (batch.placeholders[index],),
                          whole_span_when_empty=SPAN_WHEN_NO_RUN)
    item = _pb.MultimodalItem(
        modality=PROTO_MODALITY[batch.modality], content_hash=content_hash(batch.mm_hashes[index]),
        placeholders=[_pb.PlaceholderRange(offset=r.offset, length=r.length) for r in runs],
        placeholder_token_id=batch.placeholder_token_id)
    primary = batch.primary_key
    for spec in batch.specs:
        if spec.name == primary or spec.name not in batch.tensors:
            continue
        # Side tensors keep their dtype: the servicer does not cast them (video timing values).
        item.model_specific_tensors[spec.name].CopyFrom(
            _tensor_data(item_share(batch, spec.name, index), "", wire, lease, spec.name))
    if with_input:
        tensor = batch.tensors.get(primary)
        if isinstance(tensor, PendingTensor) or tensor is None:
            raise _bug("the encoder input must be materialized before this leg is built")
        if tensor.dtype != np.float32:
            # The servicer casts only floating features to the model dtype: raw uint8 pixels
            # (device normalization) would reach the tower unnormalized.
            raise _bug("the TokenSpeed wire takes float32 normalized encoder input")
        share, dtype_name = convert_encoder_input(item_share(batch, primary, index),
                                                  wire.encoder_dtype_for(batch.modality))
        item.encoder_input.CopyFrom(_tensor_data(share, dtype_name, wire, lease, primary))
    return item


async def materialize(req: PreparedRequest) -> PreparedRequest:
    """``req`` with every :class:`PendingTensor` computed into an array (its dtype and shape)."""
    batches = []
    for batch in req.batches:
        tensors = dict(batch.tensors)
        for name, tensor in batch.tensors.items():
            if isinstance(tensor, PendingTensor):
                array = np.empty(tensor.shape, dtype=tensor.dtype)
                await tensor.fill(BufferTarget(array.reshape(-1).view(np.uint8), tensor.width,
                                               tensor.dtype.itemsize, owner=array, values=tensor.dtype))
                tensors[name] = array
        batches.append(dataclasses.replace(batch, tensors=tensors))
    return dataclasses.replace(req, batches=tuple(batches))


# --- sampling ----------------------------------------------------------------------------------------

def _check(name: str, value: int | None, bounds: tuple[int, int]) -> None:
    check_range(name, value, bounds, suffix=" on this engine")


def sampling_message(s: SamplingParams) -> tokenspeed_scheduler_pb2.SamplingParams:
    """The wire ``SamplingParams`` (``tokenspeed_scheduler.proto``) as the servicer's
    ``_sampling_params_from_proto`` reads it.

    Optional scalars are forwarded when set (``HasField``): temperature only when the request
    has one, the others always (mmgate's values are the resolved ones).  ``top_k`` 0 (off) is
    sent as -1, the engine's "disabled" (SMG's default); ``seed`` -> ``sampling_seed``
    (``uint64``: a negative seed cannot be carried); ``min_tokens`` -> ``min_new_tokens``;
    ``include_stop_str_in_output`` -> ``no_stop_trim``; ``logit_bias`` keys are token ids as
    text (``map<string, float>``).  Constraints: ``json_object`` is the schema
    ``{"type": "object"}`` (SMG ``build_constraint_for_chat``), ``grammar`` -> ``ebnf_grammar``,
    ``choice`` an EBNF alternation of the literal choices, the rest by name.

    Raises:
        GatewayError(INVALID_REQUEST): a value outside its wire field's range (names the field).
    """
    top_k = -1 if s.top_k <= 0 else s.top_k
    _check("max_tokens", s.max_tokens, UINT32)
    _check("top_k", top_k, INT32)
    _check("seed", s.seed, UINT64)
    _check("n", s.n, UINT32)
    _check("min_tokens", s.min_tokens, UINT32)
    for token in s.stop_token_ids:
        _check("stop_token_ids", token, UINT32)
    sampling = _pb.SamplingParams(
        top_p=s.top_p, top_k=top_k, min_p=s.min_p, frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty, repetition_penalty=s.repetition_penalty, min_new_tokens=s.min_tokens,
        stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens, spaces_between_special_tokens=s.spaces_between_special_tokens,
        n=s.n, logit_bias={str(token): bias for token, bias in s.logit_bias},
        no_stop_trim=s.include_stop_str_in_output)
    if s.temperature is not None:
        sampling.temperature = s.temperature
    if s.max_tokens is not None:
        sampling.max_new_tokens = s.max_tokens
    if s.seed is not None:
        sampling.sampling_seed = s.seed
    c = s.constraint
    if c is not None:
        if c.kind is ConstraintKind.JSON_OBJECT:
            sampling.json_schema = json.dumps({"type": "object"})
        elif c.kind is ConstraintKind.GRAMMAR:
            sampling.ebnf_grammar = c.value
        elif c.kind is ConstraintKind.CHOICE:
            sampling.ebnf_grammar = choice_grammar(json.loads(c.value))
        else:
            setattr(sampling, c.kind.value, c.value)  # json_schema, regex, structural_tag
    return sampling


# --- requests ----------------------------------------------------------------------------------------

def build_generate_request(req: PreparedRequest, role: Role, wire: WirePlan = INLINE_FLOAT32,
                           lease: ShmLease | None = None, kv_bootstrap: Bootstrap | None = None,
                           encode_bootstrap: Sequence[Bootstrap] | None = None,
                           ) -> tokenspeed_scheduler_pb2.GenerateRequest:
    """The scheduler's ``GenerateRequest`` for one leg.

    ``role``: SINGLE and PREFILL carry each item's encoder input; DECODE carries items without
    it and never a shm handle (SMG ``request_execution.rs``: ``clear_mm_pixel_values`` keeps
    the metadata the decode engine needs for placeholder padding and M-RoPE).  PREFILL and
    DECODE carry the same ``kv_bootstrap_info`` (the prefill's bootstrap host/port, one room
    per request).  ``encode_bootstrap`` (EPD, PREFILL only): one entry per item in prompt
    order (the item's encode worker's bootstrap host/port and its room); the prefill then
    gets no encoder input.  Each modality's encoder input is sent in ``wire.encoder_dtype_for`` it.
    Segments go into ``lease``; the caller releases it when the request ends.

    Raises:
        GatewayError(INVALID_REQUEST): a sampling value the wire cannot carry.
        GatewayError(INTERNAL_ERROR): a leg built against its contract (role / bootstrap
            mismatch, a pending encoder input on a leg that carries it).
    """
    if role is Role.ENCODE:
        raise _bug("an encode leg is built with build_encode_request")
    if (kv_bootstrap is None) != (role is Role.SINGLE):
        raise _bug(f"kv bootstrap is for prefill and decode legs, and they need one (role {role})")
    items = prompt_items(req)
    epd = bool(encode_bootstrap) and bool(items)
    if encode_bootstrap and (role is not Role.PREFILL or len(encode_bootstrap) != len(items)):
        raise _bug(f"encode bootstrap: {len(encode_bootstrap)} entries for a {role} leg of {len(items)} items")
    msg = _pb.GenerateRequest(
        request_id=req.request_id,
        tokenized=_pb.TokenizedInput(input_ids=list(req.input_ids), original_text=req.prompt_text),
        sampling_params=sampling_message(req.sampling), stream=req.stream)
    if req.sampling.logprobs is not None:
        _check("logprobs", req.sampling.logprobs, INT32)
        msg.return_logprob = True
        msg.top_logprobs_num = req.sampling.logprobs
    with_input = role is not Role.DECODE and not epd
    shm_lease = None if role is Role.DECODE else lease
    for batch, index in items:
        msg.mm_inputs.items.append(_item(req, batch, index, with_input, wire, shm_lease))
    if epd:
        assert encode_bootstrap is not None
        for index, boot in enumerate(encode_bootstrap):
            _check_bootstrap(boot)
            msg.encode_bootstrap_info.items.append(_pb.EncodeItemBootstrapInfo(
                item_index=index, bootstrap_host=boot.host, bootstrap_port=boot.port, bootstrap_room=boot.room))
    if kv_bootstrap is not None:
        _check_bootstrap(kv_bootstrap)
        msg.kv_bootstrap_info.CopyFrom(_pb.KvBootstrapInfo(
            bootstrap_host=kv_bootstrap.host, bootstrap_port=kv_bootstrap.port, bootstrap_room=kv_bootstrap.room))
    return msg


def _check_bootstrap(boot: Bootstrap) -> None:
    if not (0 < boot.port < 65536 and INT63[0] <= boot.room <= INT63[1]):
        raise _bug(f"bootstrap port {boot.port} / room outside the wire's int32 / 63-bit range")


def build_encode_request(req: PreparedRequest, item_index: int, bootstrap: Bootstrap,
                         wire: WirePlan = INLINE_FLOAT32, lease: ShmLease | None = None,
                         ) -> tokenspeed_encoder_pb2.EncodeRequest:
    """The ``EncodeRequest`` of item ``item_index`` (prompt order) for its encode worker.

    The encoder servicer takes exactly one item and one room per RPC (``Encode``); the item is
    the prefill's item with its encoder input (same placeholders, hash and side tensors),
    ``items[0].bootstrap_room`` the room the prefill's ``EncodeItemBootstrapInfo`` names.
    ``bootstrap.host``/``port`` are the encode worker's own (they go to the prefill leg).

    Raises:
        GatewayError(INTERNAL_ERROR): no such item, or its encoder input is not materialized.
    """
    items = prompt_items(req)
    if not 0 <= item_index < len(items):
        raise _bug(f"no item {item_index} among {len(items)}")
    _check_bootstrap(bootstrap)
    batch, index = items[item_index]
    item = _item(req, batch, index, True, wire, lease)
    return tokenspeed_encoder_pb2.EncodeRequest(
        request_id=f"{req.request_id}-encode-{item_index}",
        mm_inputs=_pb.MultimodalInputs(items=[item]),
        items=[tokenspeed_encoder_pb2.EncodeItemAssignment(bootstrap_room=bootstrap.room)])


# --- responses ---------------------------------------------------------------------------------------


def events(resp: tokenspeed_scheduler_pb2.GenerateResponse) -> list[EngineEvent]:
    """The neutral events of one ``GenerateResponse`` (one ``chunk`` or one ``complete``; none if empty).

    The servicer (``_chunk_response`` / ``_complete_response``) sends each choice's ids with the
    trailing matched stop token trimmed unless ``no_stop_trim``; ``finish_reason`` is ``stop``,
    ``length`` or ``abort``; the stop that ended a choice is ``matched_token_id`` or
    ``matched_stop_str`` (neither for EOS).
    """
    return response_events(resp)
