"""vLLM engine wire (``vllm.grpc.engine.VllmEngine`` of ``smg-grpc-proto``).

Stage: assemble + transport.  In: a :class:`~mmgate.types.PreparedRequest`
after worker selection; out: the ``GenerateRequest`` (a message, or its bytes
with pending pixels placed in their buffer: :func:`encode_generate_request`);
back: each ``GenerateResponse`` as neutral :class:`~mmgate.engines.base.EngineEvent`
values (:func:`events`).  The wire's adapter (:class:`mmgate.engines.adapter.VllmAdapter`)
plugs these into the engine seam; the one client (:mod:`mmgate.engines.client`) sends them.

The message layout mirrors what the SMG servicer reads
(``smg_grpc_servicer/vllm/servicer.py`` ``_build_preprocessed_mm_inputs``,
smg-grpc-servicer 0.14.1): the first batch in ``mm_inputs``, further
modalities in ``extra_mm_inputs``; the primary encoder tensor in
``pixel_values``, the others in ``model_specific_tensors``; field layouts in
``batched_keys`` / ``flat_keys`` / ``keep_on_cpu_keys``.

Prefill/decode disaggregation (``routing/disagg.py``; docs/disaggregation.md), as the Rust
gateway SMG runs it on this wire (``model_gateway/src/routers/grpc/common/stages/request_execution.rs``
``execute_sequential_pd``, ``proto_wrapper.rs`` ``sanitize_sampling_for_prefill`` /
``set_kv_transfer_params_json``): the prefill leg goes first, its sampling sanitized to one token
(``max_tokens`` 1, ``min_tokens`` 0, ``n`` 1, no stops, ``ignore_eos``), not streamed, tagged
``kv_transfer_params_json`` = :data:`PREFILL_KV_TRANSFER_PARAMS`, with the media as a single leg
carries them (:func:`encode_generate_request` with ``prefill_kv_transfer_params``); the decode leg is
the request as the client asked for it, with the JSON the prefill's ``GenerateComplete`` answered and
the media's identity only (:func:`build_decode_request`: hashes, placeholder ranges and the
non-encoder tensors, the grids; no ``pixel_values``, never shared memory).  The servicer reads that
pixel-less form as "the PD decode side's" (``smg_grpc_servicer/vllm/servicer.py`` ``Generate``:
``has_preprocessed_mm_payload``, ``batches_missing_pixels`` refused without ``kv_transfer_params``).
A language-model-only decode worker gets the hashes and placeholders alone: a payload with no
tensor takes the servicer's cache-salt path (``mm_salt.py`` ``mm_identity_cache_salt``), the only
form an engine without multimodal inputs accepts.

RPC failures map to the error table as :mod:`mmgate.engines.rpc_errors` says (the same for
every wire; its names are re-exported here for the reference engine).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
from smg_grpc_proto.generated import vllm_engine_pb2

from mmgate.observe import metrics
from mmgate.engines.base import EncodedRequest, EngineEvent
from mmgate.engines.codec import VLLM_PIXEL_TAGS, Tail, join_tail
from mmgate.engines.responses import response_events
from mmgate.engines.rpc_errors import (
    carried_error_details,
    map_rpc_error,
    parse_carried_error,
)
from mmgate.engines.wire_values import (
    INT32,
    PROTO_MODALITY,
    UINT32,
    check_range,
    count_sent,
    servicer_array,
    servicer_dtype_name,
    shm_handle,
    tensor_data,
    wire_form,
)
from mmgate.transport import shm
from mmgate.transport.dtypes import convert_encoder_input
from mmgate.transport.inline import to_tensor_data
from mmgate.transport.placement import ShmTarget
from mmgate.transport.policy import INLINE_FLOAT32, WirePlan
from mmgate.transport.shm import ShmLease
from mmgate.types import (
    Constraint,
    ConstraintKind,
    EncoderBatch,
    MediaRef,
    PendingTensor,
    PreparedRequest,
    RowTarget,
    SamplingParams,
)

ENGINE = "vllm"
__all__ = ["ENGINE", "PREFILL_KV_TRANSFER_PARAMS", "EncodedRequest", "build_decode_request",
           "build_generate_request", "build_media_ref_request", "build_mm_inputs", "carried_error_details",
           "encode_generate_request", "events", "map_rpc_error", "parse_carried_error", "sampling_message"]
#: the wire field of the encoder input; a family whose encoder input has another name sends it
#: here too and names it in ``encoder_input_key`` (``smg_grpc_servicer/vllm/mm_keys.py``)
DEFAULT_PRIMARY_KEY = "pixel_values"
#: the prefill leg's ``kv_transfer_params_json``: SMG's ``NIXL_PREFILL_KV_PARAMS`` (``request_execution.rs``);
#: the engine keeps the prompt's KV for a remote decode and answers the handoff params in its Complete
PREFILL_KV_TRANSFER_PARAMS = json.dumps({"do_remote_decode": True, "do_remote_prefill": False},
                                        separators=(",", ":"))


def _sent(name: str, path: str, nbytes: int) -> None:
    count_sent(ENGINE, name, path, nbytes)


def _tensor_data(array: np.ndarray, dtype_name: str, wire: WirePlan,
                 lease: ShmLease | None, key: str = DEFAULT_PRIMARY_KEY) -> vllm_engine_pb2.TensorData:
    """Inline or shared-memory ``TensorData`` for tensor ``key`` (shm failures fall back to inline)."""
    return tensor_data(array, dtype_name, wire, lease, key, engine=ENGINE, message=vllm_engine_pb2.TensorData)


def build_mm_inputs(batch: EncoderBatch, wire: WirePlan = INLINE_FLOAT32,
                    lease: ShmLease | None = None) -> vllm_engine_pb2.MultimodalInputs:
    """One :class:`EncoderBatch` of arrays -> ``MultimodalInputs``.

    The primary float32 tensor is converted to ``wire.encoder_dtype``; each
    tensor of at least ``wire.shm_min_bytes`` goes through shared memory when
    the plan allows it (segments recorded in ``lease``), else inline.
    """
    mm = vllm_engine_pb2.MultimodalInputs(
        im_token_id=batch.placeholder_token_id,
        mm_placeholders=[vllm_engine_pb2.PlaceholderRange(offset=r.offset, length=r.length) for r in batch.placeholders],
        mm_hashes=list(batch.mm_hashes),
        batched_keys=list(batch.batched_keys),
        flat_keys=dict(batch.flat_keys),
        keep_on_cpu_keys=list(batch.keep_on_cpu_keys),
        modality=PROTO_MODALITY[batch.modality],
    )
    primary_key = batch.primary_key
    if primary_key != DEFAULT_PRIMARY_KEY:
        mm.encoder_input_key = primary_key
    for name, array in batch.tensors.items():
        assert isinstance(array, np.ndarray), "a pending tensor is placed by encode_generate_request"
        dtype_name = ""
        if name == primary_key:
            array, dtype_name = convert_encoder_input(array, wire.encoder_dtype)
        td = _tensor_data(array, dtype_name, wire, lease, name)
        if name == primary_key:
            mm.pixel_values.CopyFrom(td)
        else:
            mm.model_specific_tensors[name].CopyFrom(td)
    return mm


def _place_pending(pending: PendingTensor, wire: WirePlan, lease: ShmLease | None, first: bool,
                   targets: list[tuple[PendingTensor, RowTarget]],
                   key: str = DEFAULT_PRIMARY_KEY) -> tuple[vllm_engine_pb2.TensorData, Tail | None]:
    """The ``TensorData`` of a pending primary tensor: a new shm segment (its target recorded in
    ``targets``) when the plan allows, else inline at the end of the request (first batch only)."""
    rows, width = pending.rows, pending.width
    # raw_pixels: uint8 pixels travel for a device-normalizing worker (``vllm/servicer.py``
    # ``_build_preprocessed_mm_inputs`` decodes any ``TensorData`` dtype; ``mm_device_do_normalize``)
    dtype_name, itemsize, convert = wire_form(pending.dtype, wire.encoder_dtype, raw_pixels=True)
    nbytes = rows * width * itemsize
    shape = list(pending.shape)
    if lease is not None and wire.use_shm(nbytes):
        try:
            name = shm.create_segment(nbytes, reserve=False)  # pages come with the pool's writes
        except shm.ShmError:
            metrics.SHM_WRITE_FAILURES.labels(ENGINE).inc()
        else:
            lease.add(name)
            targets.append((pending, ShmTarget(name, width, itemsize, convert)))
            _sent(key, "shm", nbytes)
            return vllm_engine_pb2.TensorData(shape=shape, dtype=dtype_name, shm=shm_handle(name, nbytes)), None
    assert first, "the pipeline defers only the first batch's pixels"
    _sent(key, "inline", nbytes)
    return (vllm_engine_pb2.TensorData(shape=shape, dtype=dtype_name),
            Tail(nbytes=nbytes, pending=pending, width=width, itemsize=itemsize, convert=convert))


#: integer fields of ``vllm_engine.proto`` ``SamplingParams`` and the range their wire type carries
_WIRE_INT_RANGES = {"max_tokens": UINT32, "top_k": UINT32, "seed": INT32,
                    "n": UINT32, "min_tokens": UINT32, "logprobs": INT32}


def sampling_message(s: SamplingParams) -> vllm_engine_pb2.SamplingParams:
    """The wire ``SamplingParams`` of a request's sampling fields.

    Field types from ``smg_grpc_proto`` ``vllm_engine.proto`` ``SamplingParams``:
    ``optional uint32 max_tokens``, ``uint32 top_k`` (0 = disabled; vLLM's -1
    is sent as 0), ``optional int32 seed``, ``uint32 n`` / ``min_tokens``,
    ``optional int32 logprobs`` (unset: none; vLLM's ``logprobs=top_logprobs if
    logprobs``), ``map<int32, float> logit_bias``, ``float`` for the rest.  The API
    layer (``parse_chat_request``) already refuses values outside these
    ranges; a value that still does not fit is refused here with 400
    ``invalid_request`` naming the field, never a ``ValueError`` (500) from protobuf.

    Raises:
        GatewayError(INVALID_REQUEST): an integer field outside its wire range.
    """
    top_k = max(s.top_k, 0)
    for name, value in (("max_tokens", s.max_tokens), ("top_k", top_k), ("seed", s.seed), ("n", s.n),
                        ("min_tokens", s.min_tokens), ("logprobs", s.logprobs)):
        check_range(name, value, _WIRE_INT_RANGES[name])
    sampling = vllm_engine_pb2.SamplingParams(
        top_p=s.top_p, top_k=top_k, frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        skip_special_tokens=s.skip_special_tokens, spaces_between_special_tokens=s.spaces_between_special_tokens,
        ignore_eos=s.ignore_eos, n=s.n, min_p=s.min_p, min_tokens=s.min_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output, logit_bias=dict(s.logit_bias),
    )
    if s.logprobs is not None:
        sampling.logprobs = s.logprobs
    if s.temperature is not None:
        sampling.temperature = s.temperature
    if s.max_tokens is not None:
        sampling.max_tokens = s.max_tokens
    if s.seed is not None:
        sampling.seed = s.seed
    if s.constraint is not None:
        _set_constraint(sampling, s.constraint)
    return sampling


def _set_constraint(sampling: vllm_engine_pb2.SamplingParams, constraint: Constraint) -> None:
    """Set the wire's ``SamplingParams.constraint`` oneof (``vllm_engine.proto``; vLLM ``StructuredOutputsParams``).

    ``json_schema`` / ``regex`` / ``grammar`` / ``structural_tag`` carry the text,
    ``json_object`` is ``true``, ``choice`` is a ``ChoiceConstraint`` of the choices.
    """
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        sampling.json_object = True
    elif kind is ConstraintKind.CHOICE:
        sampling.choice.choices.extend(json.loads(constraint.value))
    else:
        setattr(sampling, kind.value, constraint.value)


def _prefill_leg(msg: vllm_engine_pb2.GenerateRequest, kv_transfer_params: str) -> None:
    """Make ``msg`` the prefill leg of a PD pair (SMG ``sanitize_sampling_for_prefill(1)``, ``set_stream(false)``,
    ``set_kv_transfer_params_json``): one token, one choice, no stop that could end it before the length cap
    (vLLM's NixlConnector hands the KV over only for a length-capped finish), not streamed."""
    sampling = msg.sampling_params
    sampling.max_tokens = 1
    sampling.min_tokens = 0
    sampling.n = 1
    del sampling.stop[:]
    del sampling.stop_token_ids[:]
    sampling.ignore_eos = True
    msg.stream = False
    msg.kv_transfer_params_json = kv_transfer_params


def _base_message(req: PreparedRequest) -> vllm_engine_pb2.GenerateRequest:
    return vllm_engine_pb2.GenerateRequest(
        request_id=req.request_id,
        tokenized=vllm_engine_pb2.TokenizedInput(original_text=req.prompt_text, input_ids=list(req.input_ids)),
        sampling_params=sampling_message(req.sampling),
        stream=req.stream,
    )


def _build(req: PreparedRequest, wire: WirePlan, lease: ShmLease | None, defer_primary: bool,
           targets: list[tuple[PendingTensor, RowTarget]] | None = None, prefill_kv_transfer_params: str | None = None,
           ) -> tuple[vllm_engine_pb2.GenerateRequest, Tail | None]:
    msg = _base_message(req)
    if prefill_kv_transfer_params is not None:
        _prefill_leg(msg, prefill_kv_transfer_params)
    tail: Tail | None = None
    for i, batch in enumerate(req.batches):
        key = batch.primary_key
        primary = batch.tensors.get(key)
        if isinstance(primary, PendingTensor) or (i == 0 and defer_primary and primary is not None):
            rest = EncoderBatch(
                modality=batch.modality, tensors={k: v for k, v in batch.tensors.items() if k != key},
                specs=batch.specs, placeholder_token_id=batch.placeholder_token_id,
                placeholders=batch.placeholders, mm_hashes=batch.mm_hashes)
            mm = build_mm_inputs(rest, wire, lease)
            if isinstance(primary, PendingTensor):
                assert targets is not None, "a pending tensor needs encode_generate_request"
                td, tail_i = _place_pending(primary, wire, lease, i == 0, targets, key)
                mm.pixel_values.CopyFrom(td)
                tail = tail_i or tail
            else:
                assert primary is not None
                array, dtype_name = convert_encoder_input(primary, wire.encoder_dtype)
                if lease is not None and wire.use_shm(array.nbytes):
                    mm.pixel_values.CopyFrom(_tensor_data(array, dtype_name, wire, lease, key))
                else:
                    # Sent inline: serialize everything else now, append these bytes once at the end.
                    mm.pixel_values.CopyFrom(vllm_engine_pb2.TensorData(
                        shape=list(array.shape), dtype=servicer_dtype_name(array, key, dtype_name)))
                    tail = Tail(nbytes=array.nbytes, array=np.ascontiguousarray(array))
                    _sent(key, "inline", array.nbytes)
        else:
            mm = build_mm_inputs(batch, wire, lease)
        if i == 0:
            msg.mm_inputs.CopyFrom(mm)
        else:
            msg.extra_mm_inputs.append(mm)
    return msg, tail


def build_generate_request(req: PreparedRequest, wire: WirePlan = INLINE_FLOAT32, lease: ShmLease | None = None,
                           prefill_kv_transfer_params: str | None = None) -> vllm_engine_pb2.GenerateRequest:
    """The ``GenerateRequest`` for a prepared request of arrays (expanded ids, sampling, media).

    Shared-memory segments it creates are recorded in ``lease``; the caller
    releases the lease when the engine has answered or the request ended.
    ``prefill_kv_transfer_params``: make it the prefill leg of a PD pair (see the module docstring).
    """
    return _build(req, wire, lease, defer_primary=False, prefill_kv_transfer_params=prefill_kv_transfer_params)[0]


def identity_mm_inputs(batch: EncoderBatch, grids: bool = True) -> vllm_engine_pb2.MultimodalInputs:
    """One batch's identity for a PD decode leg: ``mm_hashes``, ``mm_placeholders``, ``im_token_id``,
    ``modality`` and, with ``grids``, every tensor but the encoder input (inline; the layout keys of
    those only).  Without ``grids`` (a language-model-only decode worker) no tensor at all."""
    primary = batch.primary_key
    mm = vllm_engine_pb2.MultimodalInputs(
        im_token_id=batch.placeholder_token_id,
        mm_placeholders=[vllm_engine_pb2.PlaceholderRange(offset=r.offset, length=r.length) for r in batch.placeholders],
        mm_hashes=list(batch.mm_hashes),
        modality=PROTO_MODALITY[batch.modality],
    )
    if not grids:
        return mm
    kept = {name: array for name, array in batch.tensors.items() if name != primary}
    mm.batched_keys.extend(k for k in batch.batched_keys if k in kept)
    mm.flat_keys.update({k: v for k, v in batch.flat_keys.items() if k in kept})
    mm.keep_on_cpu_keys.extend(k for k in batch.keep_on_cpu_keys if k in kept)
    for name, array in kept.items():
        assert isinstance(array, np.ndarray), "only the encoder input is ever pending"
        array = servicer_array(array)
        _sent(name, "inline", array.nbytes)
        mm.model_specific_tensors[name].CopyFrom(to_tensor_data(array, servicer_dtype_name(array, name)))
    return mm


def build_decode_request(req: PreparedRequest, kv_transfer_params: str | None,
                         grids: bool = True) -> vllm_engine_pb2.GenerateRequest:
    """The decode leg of a PD pair: the request as asked (sampling, ``n``, ``stream``), the prefill's
    ``kv_transfer_params_json`` (None: none relayed, the engine computes the prompt itself), and each
    batch's identity only (:func:`identity_mm_inputs`): no pixels, nothing in shared memory, so it
    never names a segment the prefill leg's lease unlinks."""
    msg = _base_message(req)
    if kv_transfer_params is not None:
        msg.kv_transfer_params_json = kv_transfer_params
    for i, batch in enumerate(req.batches):
        mm = identity_mm_inputs(batch, grids)
        if i == 0:
            msg.mm_inputs.CopyFrom(mm)
        else:
            msg.extra_mm_inputs.append(mm)
    return msg


def encode_generate_request(req: PreparedRequest, wire: WirePlan = INLINE_FLOAT32, lease: ShmLease | None = None,
                            prefill_kv_transfer_params: str | None = None) -> EncodedRequest:
    """The serialized ``GenerateRequest``, with the large inline tensor written exactly once.

    Everything but the first batch's inline ``pixel_values`` bytes is
    serialized by protobuf; those bytes follow as one more
    ``mm_inputs { pixel_values { inline } }`` record.  Protobuf merges repeated
    occurrences of a singular message field, so the parsed message equals
    ``build_generate_request(...)`` (tested).  A :class:`PendingTensor` gets its
    buffer here, a new shared-memory segment or that record's payload inside
    ``data``, and is computed into it by ``EncodedRequest.fill``; an array is
    copied into ``data`` once.

    A segment that cannot be created falls back to inline here (counted); one
    that cannot be written (``/dev/shm`` full) makes ``EncodedRequest.fill``
    raise ``ShmError``, and the caller encodes again with shared memory off.

    ``prefill_kv_transfer_params``: make it the prefill leg of a PD pair (see the module docstring).
    """
    targets: list[tuple[PendingTensor, RowTarget]] = []
    msg, tail = _build(req, wire, lease, defer_primary=True, targets=targets,
                       prefill_kv_transfer_params=prefill_kv_transfer_params)
    return join_tail(msg.SerializeToString(), tail, VLLM_PIXEL_TAGS, targets)


def build_media_ref_request(req: PreparedRequest, refs: Sequence[MediaRef]) -> vllm_engine_pb2.GenerateRequest:
    """The ``GenerateRequest`` for worker-side processing (``--mm-processing worker``).

    ``req.input_ids`` is the *unexpanded* prompt (one anchor per item) and
    ``req.batches`` is empty; the media travel as ``media_refs`` (URLs
    verbatim, in prompt order), which the worker fetches, processes and
    expands itself.
    """
    assert not req.batches, "worker-side requests carry references, not tensors"
    msg = build_generate_request(req)
    msg.media_refs.items.extend(vllm_engine_pb2.MediaRef(modality=PROTO_MODALITY[r.modality], url=r.url) for r in refs)
    return msg


def events(resp: vllm_engine_pb2.GenerateResponse) -> list[EngineEvent]:
    """One ``GenerateResponse`` (``vllm_engine.proto``: a ``chunk`` or a ``complete`` of choice ``index``) as
    engine events: none for an empty response, else one.

    ``complete``: ``output_ids``, ``finish_reason``, the ``matched_stop`` oneof (unset for EOS: the
    servicer leaves it empty), the counts, and ``kv_transfer_params_json`` when a prefill leg sets it.
    """
    return response_events(resp, lambda d: {
        "kv_transfer_params": d.kv_transfer_params_json if d.HasField("kv_transfer_params_json") else None})
