"""SGLang engine wire (``sglang.grpc.scheduler.SglangScheduler`` of ``smg-grpc-proto``).

Stage: assemble + transport.  In: a :class:`~mmgate.types.PreparedRequest` after worker
selection, the leg's :class:`~mmgate.engines.base.Role` and, for a prefill/decode pair, the
:class:`~mmgate.engines.base.Bootstrap`; out: the ``GenerateRequest`` (a message, or its bytes
with pending pixels placed in them: :func:`encode_generate_request`).  Back: the
``GenerateResponse`` stream as neutral :class:`~mmgate.engines.base.EngineEvent` values
(:func:`events`), RPC failures as :class:`~mmgate.errors.GatewayError` (:func:`map_rpc_error`).
Pure functions: no client, no metrics (the adapter counts what it sends).

Every field is set as the SMG servicer reads it (``smg_grpc_servicer/sglang/servicer.py``,
smg-grpc-servicer 0.14.1; line numbers below are that file's), field by field in
docs/engines-sglang.md:

* ``tokenized.input_ids``: the expanded prompt (``_convert_generate_request``, l.949);
  ``original_text``: the rendered template (kept for the engine's logs, l.948).
* ``mm_inputs`` (l.976-978 parse it only when ``pixel_values`` is set): ``pixel_values`` the
  encoder input, inline bytes + shape + dtype (``TensorData`` has no shared-memory handle; read
  by ``tensor_wire.tensor_from_parts``: float32, bfloat16, float16, uint8, int64, uint32);
  ``model_specific_tensors`` every other tensor of the batch under its processor name except
  the flat layouts' sizes tensors (``patches_per_image``: vLLM's ``flat_from_sizes`` helper; the
  SGLang wire has no layouts and nothing reads it); ``im_token_id`` the batch's placeholder
  token; ``mm_placeholders`` the embedding runs (:func:`embedding_runs`), which become
  ``MultimodalDataItem.offsets`` (l.1028) and must match the encoder output row for row;
  ``modalities`` ``["image"]`` (not read by the servicer; as SMG sends it).
* The servicer builds ONE ``MultimodalDataItem`` with ``Modality.IMAGE`` (l.1037-1042) from the
  one ``mm_inputs``: a video batch, an audio batch or a second modality cannot be carried and
  is refused (``multimodal_not_supported``), as SMG's capability matrix refuses them.
* No content hashes (the proto has no field; the scheduler hashes the feature tensor itself)
  and no original media bytes (``image_data`` is never read by the servicer).
* Roles: ``single`` and ``prefill`` carry the media; ``decode`` carries none (no ``mm_inputs``:
  the decode engine gets the KV cache, and SGLang's own PD metadata, from the prefill engine);
  ``prefill`` and ``decode`` carry the same ``disaggregated_params`` (bootstrap host, port, room;
  l.959-973).  ``encode`` is not a role of this wire.
* Sampling: :func:`sampling_message`.

gRPC status -> error code: as :func:`mmgate.engines.rpc_errors.map_rpc_error` (the servicer ends a
failed stream with the same statuses: INVALID_ARGUMENT for a refused input, l.305-307 and the
scheduler's HTTP 400 through ``engine_status.grpc_code_for_http_status``; INTERNAL otherwise),
plus SGLang's over-long prompt refusal (``managers/utils.py`` ``validate_input_length``:
"Input length (N tokens) exceeds the maximum allowed length (M tokens)") ->
``context_length_exceeded``.
"""

from __future__ import annotations

import json
import re

import grpc
import numpy as np
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from mmgate.observe import metrics
from mmgate.engines.base import (
    Bootstrap,
    EncodedRequest,
    EngineEvent,
    Role,
)
from mmgate.engines.codec import SGLANG_PIXEL_TAGS, Tail, join_tail
from mmgate.engines.responses import response_events
from mmgate.engines.rpc_errors import map_rpc_error as common_map_rpc_error
from mmgate.engines.rpc_errors import parse_carried_error
from mmgate.engines.wire_values import SERVICER_DTYPES as WIRE_SERVICER_DTYPES
from mmgate.engines.wire_values import (
    check_range,
    choice_grammar,
    embedding_runs,
    servicer_array,
    servicer_dtype_name,
    wire_form,
)
from mmgate.errors import ErrorCode, GatewayError
from mmgate.transport.dtypes import EncoderDtype, convert_encoder_input
from mmgate.types import (
    Constraint,
    ConstraintKind,
    EncoderBatch,
    Modality,
    PendingTensor,
    PreparedRequest,
    SamplingParams,
    TensorLayout,
)

ENGINE = "sglang"
#: ``smg_grpc_servicer/tensor_wire.py`` ``PROTO_DTYPE_MAP``: the dtype names the servicer decodes
#: (:data:`mmgate.engines.wire_values.SERVICER_DTYPES`, shared by the wires)
SERVICER_DTYPES = WIRE_SERVICER_DTYPES
#: the modalities this wire carries (``_parse_mm_inputs`` makes every item ``Modality.IMAGE``)
MODALITIES = frozenset({Modality.IMAGE})
#: SGLang's own text for ``response_format: json_object`` (``entrypoints/openai/serving_chat.py``)
JSON_OBJECT_SCHEMA = '{"type": "object"}'
_INT32_MAX, _UINT32_MAX = 2**31 - 1, 2**32 - 1
#: ``wire_form`` raw_pixels: False.  ``tensor_wire.tensor_from_parts`` decodes uint8, but
#: ``_parse_mm_inputs`` (l.976-1042) hands ``pixel_values`` to the model as features: SGLang has no
#: device normalize, so uint8 pixels would reach the tower unnormalized
RAW_PIXELS = False
#: ``embedding_runs`` whole_span_when_empty: False.  ``_parse_mm_inputs`` (l.1035-1043) turns
#: ``mm_placeholders`` into ``MultimodalDataItem.offsets`` that must match the encoder output row for
#: row; a range without a placeholder token has no rows to receive, so it is a bug (500), not sent
SPAN_WHEN_NO_RUN = False
#: the scheduler's refusal (``managers/utils.py`` ``validate_input_length``), which the gRPC path meets
#: (it bypasses the tokenizer manager, whose wording :mod:`mmgate.engines.rpc_errors` already reads)
_CONTEXT_TOO_LONG = re.compile(r"exceeds the maximum allowed length", re.IGNORECASE)


def _internal(message: str) -> GatewayError:
    return GatewayError(ErrorCode.INTERNAL_ERROR, message)


def _invalid(field: str, message: str) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, f"{field} {message} on the SGLang wire", field)


def _in_range(name: str, value: int | None, low: int, high: int) -> None:
    check_range(name, value, (low, high), suffix=" on the SGLang wire")


def _set_constraint(sampling: pb.SamplingParams, constraint: Constraint) -> None:
    """The ``constraint`` oneof (``regex`` / ``json_schema`` / ``ebnf_grammar`` / ``structural_tag``,
    read at l.1092-1099); json_object and choice are carried as the schema and grammar they mean."""
    kind, value = constraint.kind, constraint.value
    if kind is ConstraintKind.JSON_OBJECT:
        sampling.json_schema = JSON_OBJECT_SCHEMA
    elif kind is ConstraintKind.CHOICE:
        sampling.ebnf_grammar = choice_grammar(json.loads(value))  # SGLang has no choice constraint
    elif kind is ConstraintKind.GRAMMAR:
        sampling.ebnf_grammar = value
    elif kind is ConstraintKind.JSON_SCHEMA:
        sampling.json_schema = value
    elif kind is ConstraintKind.REGEX:
        sampling.regex = value
    else:
        sampling.structural_tag = value


def sampling_message(s: SamplingParams) -> pb.SamplingParams:
    """The wire ``SamplingParams`` as ``_convert_sampling_params`` (l.1081-1153) reads it.

    proto3 cannot leave these scalars unset, so each is sent explicitly: ``temperature`` (None ->
    1.0, SGLang's ``SamplingParams`` default, as SMG sends it; 0 is greedy), ``top_p``,
    ``top_k`` (<= 0 -> 0, which the servicer reads as -1, all tokens), ``min_p``, the three
    penalties, ``n``, ``min_new_tokens``, ``ignore_eos``, ``skip_special_tokens``,
    ``spaces_between_special_tokens``, ``no_stop_trim`` (= ``include_stop_str_in_output``).
    ``max_new_tokens`` stays unset when None (the scheduler then bounds it by the context).
    ``logit_bias`` keys are token ids as text (SGLang's ``Dict[str, float]``).

    Raises:
        GatewayError(INVALID_REQUEST): ``seed`` (no field on this wire, and ``custom_params`` is a
            logit-processor payload, not a seed), ``top_p`` or ``repetition_penalty`` <= 0 (the
            servicer reads 0 as "unset"), an integer outside its wire type; each names the field.
    """
    if s.seed is not None:
        raise _invalid("seed", "cannot be carried (the SGLang scheduler proto has no seed field)")
    if s.top_p <= 0.0:
        raise _invalid("top_p", "must be greater than 0")
    if s.repetition_penalty <= 0.0:
        raise _invalid("repetition_penalty", "must be greater than 0")
    top_k = max(s.top_k, 0)
    _in_range("max_tokens", s.max_tokens, 0, _UINT32_MAX)
    _in_range("top_k", top_k, 0, _INT32_MAX)
    _in_range("n", s.n, 1, _UINT32_MAX)
    _in_range("min_tokens", s.min_tokens, 0, _UINT32_MAX)
    for token in s.stop_token_ids:
        _in_range("stop_token_ids", token, 0, _UINT32_MAX)
    sampling = pb.SamplingParams(
        temperature=1.0 if s.temperature is None else s.temperature, top_p=s.top_p, top_k=top_k, min_p=s.min_p,
        frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        skip_special_tokens=s.skip_special_tokens, spaces_between_special_tokens=s.spaces_between_special_tokens,
        n=s.n, min_new_tokens=s.min_tokens, ignore_eos=s.ignore_eos, no_stop_trim=s.include_stop_str_in_output,
        logit_bias={str(token): bias for token, bias in s.logit_bias},
    )
    if s.max_tokens is not None:
        sampling.max_new_tokens = s.max_tokens
    if s.constraint is not None:
        _set_constraint(sampling, s.constraint)
    return sampling


def _disaggregated(role: Role, bootstrap: Bootstrap | None) -> pb.DisaggregatedParams | None:
    """``disaggregated_params`` for the leg (both legs of a pair get the same host, port and room)."""
    if role is Role.ENCODE:
        raise _internal("the SGLang scheduler wire has no encode role")
    if role is Role.SINGLE:
        if bootstrap is not None:
            raise _internal("a single worker takes no bootstrap")
        return None
    if bootstrap is None:
        raise _internal(f"the {role.value} leg needs the pair's bootstrap")
    if not bootstrap.host or not 0 < bootstrap.port <= 65535 or not 0 <= bootstrap.room <= _INT32_MAX:
        # DisaggregatedParams: int32 port and room (SMG mints rooms in 0..i32::MAX)
        raise _internal(f"bootstrap {bootstrap} does not fit the SGLang wire (int32 room >= 0, port 1..65535)")
    return pb.DisaggregatedParams(bootstrap_host=bootstrap.host, bootstrap_port=bootstrap.port,
                                  bootstrap_room=bootstrap.room)


def _media_batch(req: PreparedRequest, role: Role) -> EncoderBatch | None:
    """The one image batch the leg carries (None: text only, or the decode leg).

    Raises:
        GatewayError(MULTIMODAL_NOT_SUPPORTED): video, audio, or more than one batch (on every
            role: such a request cannot be served on this wire at all).
    """
    other = sorted(b.modality.value for b in req.batches if b.modality not in MODALITIES)
    if other or len(req.batches) > 1:
        what = ", ".join(other) if other else "more than one media batch"
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                           f"SGLang workers take images only, one batch per request ({what})", "messages")
    if role is Role.DECODE or not req.batches:
        return None
    return req.batches[0]


def _tensor(array: np.ndarray, name: str, dtype_name: str = "") -> pb.TensorData:
    """Inline ``TensorData`` (``data``); int32 widened to int64, other dtypes outside
    :data:`SERVICER_DTYPES` refused (INTERNAL_ERROR)."""
    array = np.ascontiguousarray(servicer_array(array))
    wire = servicer_dtype_name(array, name, dtype_name)
    return pb.TensorData(data=array.tobytes(), shape=list(array.shape), dtype=wire)


def _mm_head(req: PreparedRequest, batch: EncoderBatch) -> pb.MultimodalInputs:
    """``mm_inputs`` without ``pixel_values``."""
    sizes = {s.sizes_key for s in batch.specs if s.layout is TensorLayout.FLAT and s.sizes_key}
    primary = batch.primary_key
    mm = pb.MultimodalInputs(
        modalities=[batch.modality.value], im_token_id=batch.placeholder_token_id,
        mm_placeholders=[pb.PlaceholderRange(offset=r.offset, length=r.length)
                         for r in embedding_runs(req.input_ids, batch.placeholder_token_id, batch.placeholders,
                                                 whole_span_when_empty=SPAN_WHEN_NO_RUN)])
    for name, value in batch.tensors.items():
        if name != primary and name not in sizes:
            assert isinstance(value, np.ndarray), "only the primary tensor may be pending"
            mm.model_specific_tensors[name].CopyFrom(_tensor(value, name))
    return mm


def _build(req: PreparedRequest, role: Role, bootstrap: Bootstrap | None, encoder_dtype: EncoderDtype,
           defer: bool) -> tuple[pb.GenerateRequest, Tail | None]:
    _in_range("logprobs", req.sampling.logprobs, 0, _INT32_MAX)  # top_logprobs_num is int32
    msg = pb.GenerateRequest(
        request_id=req.request_id,
        tokenized=pb.TokenizedInput(original_text=req.prompt_text, input_ids=list(req.input_ids)),
        sampling_params=sampling_message(req.sampling), stream=req.stream,
        return_logprob=req.sampling.logprobs is not None, top_logprobs_num=req.sampling.logprobs or 0,
        logprob_start_len=-1,  # l.997: 0 would ask for the prompt's logprobs from its first token
    )
    params = _disaggregated(role, bootstrap)
    if params is not None:
        msg.disaggregated_params.CopyFrom(params)
    batch = _media_batch(req, role)
    if batch is None:
        return msg, None
    mm = _mm_head(req, batch)
    primary = batch.tensors[batch.primary_key]
    dtype_name, itemsize, convert = wire_form(primary.dtype, encoder_dtype, raw_pixels=RAW_PIXELS)
    tail: Tail | None = None
    if isinstance(primary, PendingTensor):
        if not defer:
            raise _internal("pending pixel values are placed by encode_generate_request")
        mm.pixel_values.CopyFrom(pb.TensorData(shape=list(primary.shape), dtype=dtype_name))
        tail = Tail(nbytes=primary.rows * primary.width * itemsize, pending=primary, width=primary.width,
                     itemsize=itemsize, convert=convert)
    else:
        array, _ = convert_encoder_input(primary, encoder_dtype)
        if defer:
            mm.pixel_values.CopyFrom(pb.TensorData(shape=list(array.shape), dtype=dtype_name))
            tail = Tail(nbytes=array.nbytes, array=np.ascontiguousarray(array))
        else:
            mm.pixel_values.CopyFrom(_tensor(array, batch.primary_key, dtype_name))
    msg.mm_inputs.CopyFrom(mm)
    return msg, tail


def build_generate_request(prepared: PreparedRequest, role: Role, bootstrap: Bootstrap | None = None,
                           encoder_dtype: EncoderDtype = EncoderDtype.FLOAT32) -> pb.GenerateRequest:
    """The ``GenerateRequest`` of one leg, for a prepared request of arrays (see the module docstring).

    ``encoder_dtype``: the wire dtype of ``pixel_values`` (float32 unless the gateway is set to
    bfloat16/float16; SGLang workers publish no encoder-dtype label).  A :class:`PendingTensor`
    primary is placed only by :func:`encode_generate_request`.

    Raises:
        GatewayError: INVALID_REQUEST (a sampling field the wire cannot carry, named),
            MULTIMODAL_NOT_SUPPORTED (video, audio, two modalities), INTERNAL_ERROR (a role or
            bootstrap that does not fit, a pending or uint8 primary tensor).
    """
    return _build(prepared, role, bootstrap, encoder_dtype, defer=False)[0]


def _count_sent(msg: pb.GenerateRequest, tail: Tail | None) -> None:
    """Count the encoder tensors of a leg in ``smg_mm_tensors_total`` / ``smg_mm_tensor_bytes_total``
    (``runtime="sglang"``, ``path="inline"``: the SGLang wire has no shared memory), as the vLLM and
    TokenSpeed adapters count theirs."""
    if not msg.HasField("mm_inputs"):
        return
    for td in msg.mm_inputs.model_specific_tensors.values():
        metrics.tensor_sent(ENGINE, "inline", len(td.data))
    if tail is not None:
        metrics.tensor_sent(ENGINE, "inline", tail.nbytes)
    elif msg.mm_inputs.HasField("pixel_values"):
        metrics.tensor_sent(ENGINE, "inline", len(msg.mm_inputs.pixel_values.data))


def encode_generate_request(prepared: PreparedRequest, role: Role, bootstrap: Bootstrap | None = None,
                            encoder_dtype: EncoderDtype = EncoderDtype.FLOAT32) -> EncodedRequest:
    """The serialized ``GenerateRequest``; ``await EncodedRequest.fill()`` computes pending pixels into it.

    Everything but ``pixel_values.data`` is serialized by protobuf; the bytes follow as one more
    ``mm_inputs { pixel_values { data } }`` record, which protobuf merges into the first (the
    parsed message equals :func:`build_generate_request`'s, tested).  A :class:`PendingTensor`
    is computed straight into that record (converted to ``encoder_dtype`` block by block); an
    array is copied into it once.  The SGLang wire has no shared memory: nothing to release.  Each encoder
    tensor of the leg is counted in ``smg_mm_tensors_total{runtime="sglang",path="inline"}`` (and its bytes).

    Raises:
        GatewayError: as :func:`build_generate_request`.
    """
    msg, tail = _build(prepared, role, bootstrap, encoder_dtype, defer=True)
    head = msg.SerializeToString()
    _count_sent(msg, tail)
    return join_tail(head, tail, SGLANG_PIXEL_TAGS)


def events(resp: pb.GenerateResponse) -> list[EngineEvent]:
    """One response message -> neutral events (``_create_chunk_response`` / ``_create_completion_response``,
    l.1230-1321): a chunk's new ``token_ids``; a completion's ``output_ids``, ``finish_reason``
    (``stop``, ``length``, ``abort``) and ``matched_token_id`` / ``matched_stop_str``.  For a streamed
    request the completion repeats the last chunk's tokens (``output_ids`` of the finished output,
    l.295-298; the vLLM servicer does the same): a consumer takes a streamed choice's ids from its
    chunks.  A message with neither (never sent by the servicer) gives no event."""
    return response_events(resp)


def map_rpc_error(exc: grpc.aio.AioRpcError | grpc.RpcError) -> GatewayError:
    """The stable error for a failed SGLang RPC: :func:`mmgate.engines.rpc_errors.map_rpc_error`, with
    the SGLang scheduler's over-long prompt refusal (INVALID_ARGUMENT) read as ``context_length_exceeded``."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    if (parse_carried_error(code, details) is None and code is grpc.StatusCode.INVALID_ARGUMENT
            and _CONTEXT_TOO_LONG.search(details)):
        return GatewayError(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                            "the prompt and max_tokens do not fit the engine's context length", "messages")
    return common_map_rpc_error(exc)
