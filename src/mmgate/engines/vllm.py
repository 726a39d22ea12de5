"""vLLM engine wire (``vllm.grpc.engine.VllmEngine`` of ``smg-grpc-proto``).

Stage: assemble + transport.  In: a :class:`~mmgate.types.PreparedRequest`
after worker selection; out: a ``GenerateRequest`` and the streamed
``GenerateResponse`` messages.  Engine field names appear only here.

The message layout mirrors what the SMG servicer reads
(``smg_grpc_servicer/vllm/servicer.py`` ``_build_preprocessed_mm_inputs``,
smg-grpc-servicer 0.14.1): the first batch in ``mm_inputs``, further
modalities in ``extra_mm_inputs``; the primary encoder tensor in
``pixel_values``, the others in ``model_specific_tensors``; field layouts in
``batched_keys`` / ``flat_keys`` / ``keep_on_cpu_keys``.

gRPC status -> error code: UNAVAILABLE / DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED
-> ``engine_unavailable`` (503, retryable); INVALID_ARGUMENT /
FAILED_PRECONDITION / OUT_OF_RANGE -> ``engine_rejected`` (400, with the
engine's message, e.g. the model's placeholder/feature mismatch); anything
else -> ``engine_error`` (502).  An mmgate code the engine carries in the
details (``[code=media_fetch_timeout item=0] ...``, worker-side media
processing) wins when it agrees with the status (:func:`parse_carried_error`).
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate import metrics
from mmgate.errors import ERROR_TABLE, ErrorCode, GatewayError
from mmgate.transport import shm
from mmgate.transport.dtypes import convert_encoder_input
from mmgate.transport.inline import to_tensor_data, wire_dtype_name
from mmgate.transport.policy import INLINE_FLOAT32, WirePlan
from mmgate.transport.shm import ShmLease
from mmgate.types import EncoderBatch, MediaRef, Modality, PreparedRequest

ENGINE = "vllm"
PRIMARY_KEY = "pixel_values"
_MODALITY = {Modality.IMAGE: common_pb2.IMAGE, Modality.VIDEO: common_pb2.VIDEO, Modality.AUDIO: common_pb2.AUDIO}
_MAX_MESSAGE = 512 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
]

_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.CANCELLED}
_REJECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE}
_ERROR_CODES = frozenset(c.value for c in ErrorCode)


_CARRIED = re.compile(r"\A\[code=([a-z0-9_]+)(?: item=(\d+))?\] ?(.*)\Z", re.S)


def carried_error_details(code: ErrorCode, message: str, item: int | None = None) -> str:
    """RPC details that carry an mmgate error code from an engine to the gateway.

    Worker-side media processing (``media_refs``) ends a failed request with
    INVALID_ARGUMENT (the caller's mistake) or UNAVAILABLE (a transient fault)
    and these details, e.g. ``[code=media_fetch_timeout item=1] media fetch
    timed out``: ``item`` is the index into ``media_refs``.
    """
    where = f" item={item}" if item is not None else ""
    return f"[code={code.value}{where}] {message}"


def parse_carried_error(status: grpc.StatusCode, details: str) -> GatewayError | None:
    """The :class:`GatewayError` carried in ``details`` (see :func:`carried_error_details`), or None.

    The code is taken only when the status agrees with it (a 4xx code with
    INVALID_ARGUMENT, a retryable code with UNAVAILABLE); the item index
    becomes ``param = "media_refs[i]"``, which the forwarding path maps back
    to the content part.
    """
    match = _CARRIED.match(details)
    if match is None or match.group(1) not in _ERROR_CODES:
        return None
    code = ErrorCode(match.group(1))
    spec = ERROR_TABLE[code]
    agrees = (status in _REJECTED and spec.status < 500) or (status in _UNAVAILABLE and spec.retryable)
    if not agrees:
        return None
    param = f"media_refs[{match.group(2)}]" if match.group(2) is not None else None
    return GatewayError(code, match.group(3)[:500], param)


def map_rpc_error(exc: grpc.aio.AioRpcError | grpc.RpcError) -> GatewayError:
    """The stable error for a failed RPC (details kept, they come from the engine, not the caller).

    An mmgate code carried in the details (:func:`parse_carried_error`) wins;
    otherwise the status decides as the module docstring says.
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    carried = parse_carried_error(code, details)
    if carried is not None:
        return carried
    if code in _UNAVAILABLE:
        return GatewayError(ErrorCode.ENGINE_UNAVAILABLE, f"engine unavailable ({code.name})")
    if code in _REJECTED:
        return GatewayError(ErrorCode.ENGINE_REJECTED, f"engine rejected the request: {details[:500]}")
    return GatewayError(ErrorCode.ENGINE_ERROR, f"engine error ({code.name}): {details[:300]}")


def _tensor_data(array: np.ndarray, dtype_name: str, wire: WirePlan,
                 lease: ShmLease | None) -> vllm_engine_pb2.TensorData:
    """Inline or shared-memory ``TensorData`` for one tensor (shm failures fall back to inline)."""
    if lease is not None and wire.use_shm(array.nbytes):
        try:
            name = shm.write_segment(array)
        except shm.ShmError:
            metrics.SHM_WRITE_FAILURES.labels(ENGINE).inc()
        else:
            lease.add(name)
            metrics.MM_TENSORS.labels(ENGINE, "shm").inc()
            metrics.MM_TENSOR_BYTES.labels(ENGINE, "shm").inc(array.nbytes)
            handle = common_pb2.ShmHandle(name=name, offset=0, nbytes=array.nbytes, owner_id=f"mmgate-{os.getpid()}")
            return vllm_engine_pb2.TensorData(shape=list(array.shape), dtype=dtype_name or wire_dtype_name(array),
                                              shm=handle)
    metrics.MM_TENSORS.labels(ENGINE, "inline").inc()
    metrics.MM_TENSOR_BYTES.labels(ENGINE, "inline").inc(array.nbytes)
    return to_tensor_data(array, dtype_name or None)


def build_mm_inputs(batch: EncoderBatch, wire: WirePlan = INLINE_FLOAT32,
                    lease: ShmLease | None = None) -> vllm_engine_pb2.MultimodalInputs:
    """One :class:`EncoderBatch` -> ``MultimodalInputs``.

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
        modality=_MODALITY[batch.modality],
    )
    for name, array in batch.tensors.items():
        dtype_name = ""
        if name == PRIMARY_KEY:
            array, dtype_name = convert_encoder_input(array, wire.encoder_dtype)
        td = _tensor_data(array, dtype_name, wire, lease)
        if name == PRIMARY_KEY:
            mm.pixel_values.CopyFrom(td)
        else:
            mm.model_specific_tensors[name].CopyFrom(td)
    return mm


def _build(req: PreparedRequest, wire: WirePlan, lease: ShmLease | None,
           defer_primary: bool) -> tuple[vllm_engine_pb2.GenerateRequest, np.ndarray | None]:
    s = req.sampling
    sampling = vllm_engine_pb2.SamplingParams(
        top_p=s.top_p, top_k=s.top_k, frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
        repetition_penalty=1.0, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), skip_special_tokens=True,
        spaces_between_special_tokens=True, ignore_eos=s.ignore_eos, n=1,
    )
    if s.temperature is not None:
        sampling.temperature = s.temperature
    if s.max_tokens is not None:
        sampling.max_tokens = s.max_tokens
    if s.seed is not None:
        sampling.seed = s.seed
    msg = vllm_engine_pb2.GenerateRequest(
        request_id=req.request_id,
        tokenized=vllm_engine_pb2.TokenizedInput(original_text=req.prompt_text, input_ids=list(req.input_ids)),
        sampling_params=sampling,
        stream=req.stream,
    )
    deferred: np.ndarray | None = None
    for i, batch in enumerate(req.batches):
        if i == 0 and defer_primary and PRIMARY_KEY in batch.tensors:
            primary, dtype_name = convert_encoder_input(batch.tensors[PRIMARY_KEY], wire.encoder_dtype)
            if not (lease is not None and wire.use_shm(primary.nbytes)):
                # Sent inline: serialize everything else now, append these bytes once at the end.
                rest = EncoderBatch(
                    modality=batch.modality, tensors={k: v for k, v in batch.tensors.items() if k != PRIMARY_KEY},
                    batched_keys=batch.batched_keys, flat_keys=batch.flat_keys,
                    keep_on_cpu_keys=batch.keep_on_cpu_keys, placeholder_token_id=batch.placeholder_token_id,
                    placeholders=batch.placeholders, mm_hashes=batch.mm_hashes)
                mm = build_mm_inputs(rest, wire, lease)
                mm.pixel_values.CopyFrom(vllm_engine_pb2.TensorData(
                    shape=list(primary.shape), dtype=dtype_name or wire_dtype_name(primary)))
                msg.mm_inputs.CopyFrom(mm)
                deferred = np.ascontiguousarray(primary)
                metrics.MM_TENSORS.labels(ENGINE, "inline").inc()
                metrics.MM_TENSOR_BYTES.labels(ENGINE, "inline").inc(deferred.nbytes)
                continue
        mm = build_mm_inputs(batch, wire, lease)
        if i == 0:
            msg.mm_inputs.CopyFrom(mm)
        else:
            msg.extra_mm_inputs.append(mm)
    return msg, deferred


def build_generate_request(req: PreparedRequest, wire: WirePlan = INLINE_FLOAT32,
                           lease: ShmLease | None = None) -> vllm_engine_pb2.GenerateRequest:
    """The ``GenerateRequest`` for a prepared request (expanded ids, sampling, media).

    Shared-memory segments it creates are recorded in ``lease``; the caller
    releases the lease when the engine has answered or the request ended.
    """
    return _build(req, wire, lease, defer_primary=False)[0]


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# Field tags (field number << 3 | wire type 2): GenerateRequest.mm_inputs = 7,
# MultimodalInputs.pixel_values = 2, TensorData.inline = 1.
_TAG_MM_INPUTS, _TAG_PIXEL_VALUES, _TAG_INLINE = b"\x3a", b"\x12", b"\x0a"


def encode_generate_request(req: PreparedRequest, wire: WirePlan = INLINE_FLOAT32,
                            lease: ShmLease | None = None) -> bytes:
    """The serialized ``GenerateRequest``, with the large inline tensor copied exactly once.

    Everything but the first batch's inline ``pixel_values`` bytes is
    serialized by protobuf; those bytes are appended as one more
    ``mm_inputs { pixel_values { inline } }`` record.  Protobuf merges repeated
    occurrences of a singular message field, so the parsed message equals
    ``build_generate_request(...)`` (tested), while the payload skips the
    message-object copies.
    """
    msg, deferred = _build(req, wire, lease, defer_primary=True)
    head = msg.SerializeToString()
    if deferred is None:
        return head
    data = deferred.reshape(-1).view(np.uint8).data
    l1 = len(data)
    l2 = 1 + len(_varint(l1)) + l1
    l3 = 1 + len(_varint(l2)) + l2
    return b"".join((head, _TAG_MM_INPUTS, _varint(l3), _TAG_PIXEL_VALUES, _varint(l2), _TAG_INLINE, _varint(l1),
                     data))


def build_media_ref_request(req: PreparedRequest, refs: Sequence[MediaRef]) -> vllm_engine_pb2.GenerateRequest:
    """The ``GenerateRequest`` for worker-side processing (``--mm-processing worker``).

    ``req.input_ids`` is the *unexpanded* prompt (one anchor per item) and
    ``req.batches`` is empty; the media travel as ``media_refs`` (URLs
    verbatim, in prompt order), which the worker fetches, processes and
    expands itself.
    """
    assert not req.batches, "worker-side requests carry references, not tensors"
    msg = build_generate_request(req)
    msg.media_refs.items.extend(vllm_engine_pb2.MediaRef(modality=_MODALITY[r.modality], url=r.url) for r in refs)
    return msg


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker says about itself (GetModelInfo + GetServerInfo), flattened to labels."""

    model_type: str
    supports_vision: bool
    max_context_length: int
    eos_token_ids: tuple[int, ...]
    labels: dict[str, str]


class VllmWorkerClient:
    """An async client for one vLLM-wire worker at ``host:port``."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = vllm_engine_pb2_grpc.VllmEngineStub(self._channel)
        # Generate taking pre-serialized bytes (see encode_generate_request).
        self._generate_raw = self._channel.unary_stream(
            "/vllm.grpc.engine.VllmEngine/Generate", request_serializer=None,
            response_deserializer=vllm_engine_pb2.GenerateResponse.FromString)

    async def close(self) -> None:
        await self._channel.close()

    async def health(self, timeout_s: float = 2.0) -> bool:
        try:
            resp = await self._stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.healthy)

    async def info(self, timeout_s: float = 5.0) -> WorkerInfo:
        """Query GetModelInfo and GetServerInfo.

        Raises:
            GatewayError(ENGINE_UNAVAILABLE | ENGINE_ERROR)
        """
        try:
            model = await self._stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=timeout_s)
            server = await self._stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc) from None
        labels = {
            "model_path": model.model_path, "served_model_name": model.served_model_name,
            "model_type": model.model_type, "supports_vision": str(model.supports_vision).lower(),
            "server_type": server.server_type, "shm_namespace_id": server.shm_namespace_id,
            "mm_processor": server.mm_processor, "mm_media_ref_schemes": server.mm_media_ref_schemes,
            "mm_processor_source": server.mm_processor_source,
            "mm_device_do_normalize": str(server.mm_device_do_normalize).lower(),
            "mm_item_limits": server.mm_item_limits, "multimodal_encoder_dtype": server.multimodal_encoder_dtype,
            "max_num_seqs": str(server.max_num_seqs), "mm_encoder_budget": str(server.mm_encoder_budget),
        }
        return WorkerInfo(model_type=model.model_type, supports_vision=model.supports_vision,
                          max_context_length=model.max_context_length,
                          eos_token_ids=tuple(int(t) for t in model.eos_token_ids), labels=labels)

    async def generate(self, msg: vllm_engine_pb2.GenerateRequest | bytes,
                       timeout_s: float | None = None) -> AsyncGenerator[vllm_engine_pb2.GenerateResponse, None]:
        """Stream the engine's responses; cancels the RPC if the consumer stops early.

        ``msg`` is a message, or its serialized bytes (``encode_generate_request``).

        Raises:
            GatewayError: mapped from the RPC status (see module docstring).
        """
        call = (self._generate_raw(msg, timeout=timeout_s) if isinstance(msg, bytes)
                else self._stub.Generate(msg, timeout=timeout_s))
        try:
            async for resp in call:
                yield resp
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc) from None
        finally:
            if not call.done():
                call.cancel()

    async def abort(self, request_id: str) -> None:
        try:
            await self._stub.Abort(vllm_engine_pb2.AbortRequest(request_ids=[request_id]), timeout=2.0)
        except grpc.aio.AioRpcError:
            pass
