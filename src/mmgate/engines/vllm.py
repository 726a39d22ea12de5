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
else -> ``engine_error`` (502).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate import metrics
from mmgate.errors import ErrorCode, GatewayError
from mmgate.transport.inline import to_tensor_data
from mmgate.types import EncoderBatch, Modality, PreparedRequest

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


def map_rpc_error(exc: grpc.aio.AioRpcError | grpc.RpcError) -> GatewayError:
    """The stable error for a failed RPC (details kept, they come from the engine, not the caller)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    if code in _UNAVAILABLE:
        return GatewayError(ErrorCode.ENGINE_UNAVAILABLE, f"engine unavailable ({code.name})")
    if code in _REJECTED:
        return GatewayError(ErrorCode.ENGINE_REJECTED, f"engine rejected the request: {details[:500]}")
    return GatewayError(ErrorCode.ENGINE_ERROR, f"engine error ({code.name}): {details[:300]}")


def build_mm_inputs(batch: EncoderBatch) -> vllm_engine_pb2.MultimodalInputs:
    """One :class:`EncoderBatch` -> ``MultimodalInputs`` (tensors inline)."""
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
        td = to_tensor_data(array)
        if name == PRIMARY_KEY:
            mm.pixel_values.CopyFrom(td)
        else:
            mm.model_specific_tensors[name].CopyFrom(td)
        metrics.MM_TENSORS.labels(ENGINE, "inline").inc()
        metrics.MM_TENSOR_BYTES.labels(ENGINE, "inline").inc(array.nbytes)
    return mm


def build_generate_request(req: PreparedRequest, eos_token_ids: tuple[int, ...] = ()) -> vllm_engine_pb2.GenerateRequest:
    """The ``GenerateRequest`` for a prepared request (expanded ids, sampling, media)."""
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
    for i, batch in enumerate(req.batches):
        mm = build_mm_inputs(batch)
        if i == 0:
            msg.mm_inputs.CopyFrom(mm)
        else:
            msg.extra_mm_inputs.append(mm)
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

    async def generate(self, msg: vllm_engine_pb2.GenerateRequest,
                       timeout_s: float | None = None) -> AsyncIterator[vllm_engine_pb2.GenerateResponse]:
        """Stream the engine's responses; cancels the RPC if the consumer stops early.

        Raises:
            GatewayError: mapped from the RPC status (see module docstring).
        """
        call = self._stub.Generate(msg, timeout=timeout_s)
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
