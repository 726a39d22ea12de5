"""Codec core, part 2: the values the three wires share: tensor data, integer ranges, choice
grammars and embedding runs.

Stage: assemble -> transport.  In: arrays, sampling integers, constraint choices, the expanded
prompt and its placeholder ranges; out: ``TensorData`` messages (shared memory or inline), the
EBNF text of a choice constraint, the runs that receive embeddings; a value a wire cannot carry
as :class:`~mmgate.errors.GatewayError`.  The serialized-request tail is :mod:`mmgate.engines.codec`.

Each difference between wires is a named parameter, set by the wire module with a comment citing
the servicer line it follows (smg-grpc-servicer 0.14.1 unless said otherwise):

* :func:`wire_form` ``raw_pixels``: whether uint8 pixels may travel (vLLM device normalize) or the
  wire takes normalized float input only (SGLang);
* :func:`tensor_data` ``engine`` / ``message``: the metrics label and the wire's ``TensorData`` type;
* :func:`check_range` ``suffix``: the wire named in the refusal's message;
* :func:`embedding_runs` ``whole_span_when_empty``: a range without any placeholder token is a
  bug on SGLang, and is sent whole on TokenSpeed.

Invariants: every tensor's wire dtype is one of :data:`SERVICER_DTYPES`, the table the vLLM and
SGLang servicers decode with (an int32 array is widened to int64 by :func:`servicer_array`, any
other dtype refused as INTERNAL_ERROR); a failed shared-memory write falls back to inline (counted in
``smg_mm_shm_write_failures_total``); every tensor placed is counted once in
``smg_mm_tensors_total{runtime,path}`` and reported to the ``--log-mm-timing`` record.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from smg_grpc_proto.generated import common_pb2

from mmgate.observe import metrics, timing_log
from mmgate.errors import ErrorCode, GatewayError
from mmgate.transport import shm
from mmgate.transport.dtypes import EncoderDtype, to_bfloat16_bits, to_float16
from mmgate.transport.inline import wire_dtype_name
from mmgate.transport.placement import Convert, identity
from mmgate.transport.policy import WirePlan
from mmgate.transport.shm import ShmLease
from mmgate.types import Modality, PlaceholderRange

#: ``common.proto`` ``Modality`` of each modality (vLLM and TokenSpeed items name theirs)
PROTO_MODALITY = {Modality.IMAGE: common_pb2.IMAGE, Modality.VIDEO: common_pb2.VIDEO,
                  Modality.AUDIO: common_pb2.AUDIO}

#: the range each proto integer type carries (``INT63``: a non-negative int64, SMG's bootstrap rooms)
UINT32, INT32 = (0, 2**32 - 1), (-(2**31), 2**31 - 1)
UINT64, INT63 = (0, 2**64 - 1), (0, 2**63 - 1)


#: ``smg_grpc_servicer/tensor_wire.py`` ``PROTO_DTYPE_MAP`` (0.14.1): the only dtype names the vLLM
#: (``vllm/mm_tensors.py`` ``tensor_from_proto``) and SGLang (``_decode_tensor_data``) servicers decode;
#: a name not listed (int32 among them) fails the whole request there.  TokenSpeed's
#: ``_tensor_from_proto`` reads any numpy name, so this table is the one all three wires accept.
#: Diffed against the installed package by tests/engines/test_servicer_decoding.py.
SERVICER_DTYPES = frozenset({"float32", "bfloat16", "float16", "uint8", "int64", "uint32"})


# --- tensors ----------------------------------------------------------------------------------------

def servicer_array(array: np.ndarray) -> np.ndarray:
    """``array`` in a dtype the servicers decode: int32 (a count or grid computed in int32) widened
    to int64 (lossless; what transformers indexes grids with), anything else as it is."""
    return array.astype(np.int64) if array.dtype == np.int32 else array


def servicer_dtype_name(array: np.ndarray, name: str, dtype_name: str = "") -> str:
    """The wire dtype name of ``array`` (``dtype_name`` when given: ``bfloat16`` for the uint16 bits
    of one), checked against :data:`SERVICER_DTYPES`.

    Raises:
        GatewayError(INTERNAL_ERROR): a dtype no servicer decodes (a bug: families emit float32,
            uint8 or int64).
    """
    wire = dtype_name or wire_dtype_name(array)
    if wire not in SERVICER_DTYPES:
        raise GatewayError(ErrorCode.INTERNAL_ERROR, f"tensor {name} of dtype {wire} has no servicer dtype")
    return wire


def count_sent(engine: str, name: str, path: str, nbytes: int) -> None:
    """Count one tensor placed for ``engine`` (``smg_mm_tensors_total{runtime,path}`` and bytes) and report
    it to the request's ``--log-mm-timing`` record."""
    metrics.tensor_sent(engine, path, nbytes)
    timing_log.tensor_sent(engine, name, path, nbytes)


def shm_handle(segment: str, nbytes: int) -> common_pb2.ShmHandle:
    """``common.ShmHandle`` of a whole segment (read at offset 0 for ``nbytes``: ``mm_shm.tensor_payload_bytes``)."""
    return common_pb2.ShmHandle(name=segment, offset=0, nbytes=nbytes, owner_id=f"mmgate-{os.getpid()}")


def tensor_data(array: np.ndarray, dtype_name: str, plan: WirePlan, lease: ShmLease | None, name: str, *,
                engine: str, message: Any) -> Any:
    """``message`` (the wire's ``TensorData``) for tensor ``name``: a new shared-memory segment when
    ``lease`` is given and ``plan.use_shm`` says so, else inline bytes (a failed segment falls back
    to inline, counted).  ``dtype_name``: the wire dtype ('' = the array's own, ``bfloat16`` for the
    uint16 bits of one); ``shape`` is the array's."""
    array = np.ascontiguousarray(servicer_array(array))
    dtype_name = servicer_dtype_name(array, name, dtype_name)
    if lease is not None and plan.use_shm(array.nbytes):
        try:
            segment = shm.write_segment(array)
        except shm.ShmError:
            metrics.SHM_WRITE_FAILURES.labels(engine).inc()
        else:
            lease.add(segment)
            count_sent(engine, name, "shm", array.nbytes)
            return message(shape=list(array.shape), dtype=dtype_name, shm=shm_handle(segment, array.nbytes))
    count_sent(engine, name, "inline", array.nbytes)
    return message(shape=list(array.shape), dtype=dtype_name, inline=array.tobytes())


def wire_form(dtype: np.dtype, encoder_dtype: EncoderDtype, *, raw_pixels: bool) -> tuple[str, int, Convert]:
    """(wire dtype name, bytes per value, block conversion) of a pending or deferred encoder input.

    float32 input is converted to ``encoder_dtype``.  ``raw_pixels``: other dtypes (uint8 pixels for a
    worker that normalizes on device) travel as they are; without it they are refused.

    Raises:
        GatewayError(INTERNAL_ERROR): a non-float32 input on a wire without ``raw_pixels``.
    """
    if dtype != np.float32:
        if not raw_pixels:
            raise GatewayError(ErrorCode.INTERNAL_ERROR,
                               f"this wire takes normalized float encoder input, not {dtype} (no device normalize)")
        return servicer_dtype_name(np.empty(0, dtype=dtype), "encoder input"), dtype.itemsize, identity
    if encoder_dtype is EncoderDtype.BFLOAT16:
        return "bfloat16", 2, to_bfloat16_bits
    if encoder_dtype is EncoderDtype.FLOAT16:
        return "float16", 2, to_float16
    return "float32", 4, identity


# --- integers ---------------------------------------------------------------------------------------

def check_range(name: str, value: int | None, bounds: tuple[int, int], *, suffix: str = "",
                param: str | None = None) -> None:
    """Refuse ``value`` outside ``bounds`` (its wire field's type) with 400 ``invalid_request`` naming
    ``param`` (default ``name``), never a ``ValueError`` (500) from protobuf; None passes.
    ``suffix``: the wire named after the message (" on the SGLang wire")."""
    low, high = bounds
    if value is not None and not low <= value <= high:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"{name} must be within [{low}, {high}]{suffix}",
                           param or name)


# --- constraints ------------------------------------------------------------------------------------

_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _ebnf_char(ch: str) -> str:
    if ch in _EBNF_ESCAPES:
        return _EBNF_ESCAPES[ch]
    # \uXXXX, fixed width: xgrammar reads \x greedily (\x0ab is U+0AB), so \x would eat a hex digit after it
    return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar of exactly ``choices``, for a wire without a choice constraint (vLLM
    ``v1/structured_output/utils.py`` ``choice_as_grammar``, with line breaks and control characters
    escaped as xgrammar's EBNF reads them).

    Both servicers that take it hand ``ebnf_grammar`` to the engine unchanged (``sglang/servicer.py``
    ``_convert_sampling_params`` -> ``SamplingParams.ebnf``; ``tokenspeed/servicer.py``
    ``_sampling_params_from_proto`` -> ``out["ebnf"]``), and both engines compile it with xgrammar, so
    one text serves both.  Example: ``["a", 'b"']`` -> ``root ::= "a" | "b\\""``.
    """
    return "root ::= " + " | ".join('"' + "".join(_ebnf_char(c) for c in s) + '"' for s in choices)


# --- placeholders -----------------------------------------------------------------------------------

def embedding_runs(input_ids: Sequence[int], token_id: int, ranges: Sequence[PlaceholderRange], *,
                   whole_span_when_empty: bool) -> tuple[PlaceholderRange, ...]:
    """The runs of ``token_id`` inside each range, in order: the positions that receive embeddings.

    A Qwen image's range is one run already; a Qwen3-VL clip's range spans per-frame timestamp
    text and ``<|vision_start|>``/``<|vision_end|>`` markers, and gives one run per frame.
    Example: ids ``[9, S, P, P, E, S, P, P, E]`` with range ``(1, 8)`` -> ``(2, 2), (6, 2)``.
    ``whole_span_when_empty``: a range holding no ``token_id`` is sent whole (else refused).

    Raises:
        GatewayError(INTERNAL_ERROR): a range outside the prompt, or (without ``whole_span_when_empty``)
            one without any ``token_id``.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    runs: list[PlaceholderRange] = []
    for r in ranges:
        if r.offset < 0 or r.length <= 0 or r.offset + r.length > ids.size:
            raise GatewayError(ErrorCode.INTERNAL_ERROR,
                               f"placeholder range {r} lies outside the prompt of {ids.size} tokens")
        hit = np.concatenate(([0], (ids[r.offset:r.offset + r.length] == token_id).astype(np.int8), [0]))
        edges = np.flatnonzero(np.diff(hit))
        if edges.size == 0:
            if not whole_span_when_empty:
                raise GatewayError(ErrorCode.INTERNAL_ERROR,
                                   f"placeholder range {r} holds no placeholder token {token_id}")
            runs.append(r)
        runs.extend(PlaceholderRange(r.offset + int(a), int(b - a)) for a, b in zip(edges[0::2], edges[1::2]))
    return tuple(runs)
