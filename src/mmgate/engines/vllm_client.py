"""Async client of one vLLM-wire worker (``vllm.grpc.engine.VllmEngine`` of ``smg-grpc-proto``).

Stage: transport.  Generate (streamed; a message or pre-serialized bytes from
:func:`mmgate.engines.vllm.encode_generate_request`), HealthCheck, GetModelInfo +
GetServerInfo flattened to worker labels, Abort.  RPC failures become the stable
errors of :func:`mmgate.engines.vllm.map_rpc_error`.

Health probes (:meth:`VllmWorkerClient.probe`) classify a failure instead of
folding it into ``False``: nothing listening (``UNAVAILABLE``) is told apart from
a probe that ran out of time (``DEADLINE_EXCEEDED``, a busy worker looks like
that) so that :mod:`mmgate.routing.workers` can tell busy from dead.
``last_answer`` is when any RPC of this client last got a message back (a
Generate stream answering is proof of life too).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from enum import StrEnum

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.engines.vllm import map_rpc_error
from mmgate.transport.limits import GRPC_MAX_MESSAGE_BYTES

_MAX_MESSAGE = GRPC_MAX_MESSAGE_BYTES
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    # A restarted worker is reconnected within a few seconds (gRPC's default backoff grows to 120 s).
    ("grpc.max_reconnect_backoff_ms", 5000),
]


class ProbeOutcome(StrEnum):
    """What one health probe of a worker found."""

    OK = "ok"  # HealthCheck said healthy and the info RPCs answered
    NOT_SERVING = "not_serving"  # the worker answered, and said it is not healthy
    UNREACHABLE = "unreachable"  # UNAVAILABLE: nothing listening, connection refused or reset
    TIMEOUT = "timeout"  # DEADLINE_EXCEEDED: no answer in time (busy or hung)
    ERROR = "error"  # any other RPC status


def probe_outcome(code: grpc.StatusCode) -> ProbeOutcome:
    """The outcome a failed probe RPC with status ``code`` counts as."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return ProbeOutcome.UNREACHABLE
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ProbeOutcome.TIMEOUT
    return ProbeOutcome.ERROR


@dataclass(frozen=True, slots=True)
class Probe:
    """One health probe: its outcome, and the worker's info when it answered everything."""

    outcome: ProbeOutcome
    info: WorkerInfo | None = None


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
        self.last_answer = 0.0  # time.monotonic() of the last message any RPC got back; 0.0: none yet
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = vllm_engine_pb2_grpc.VllmEngineStub(self._channel)
        # Generate taking pre-serialized bytes (see encode_generate_request).
        self._generate_raw = self._channel.unary_stream(
            "/vllm.grpc.engine.VllmEngine/Generate", request_serializer=None,
            response_deserializer=vllm_engine_pb2.GenerateResponse.FromString)

    async def close(self) -> None:
        await self._channel.close()

    async def health(self, timeout_s: float = 2.0) -> bool:
        """Whether HealthCheck answers ``healthy`` within ``timeout_s`` seconds (any failure: ``False``)."""
        try:
            resp = await self._stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        self.last_answer = time.monotonic()
        return bool(resp.healthy)

    async def probe(self, timeout_s: float = 2.0) -> Probe:
        """HealthCheck, then GetModelInfo + GetServerInfo, each within ``timeout_s`` seconds.

        Never raises for an RPC failure: it is classified (see :class:`ProbeOutcome`).
        """
        try:
            resp = await self._stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return Probe(probe_outcome(exc.code()))
        self.last_answer = time.monotonic()
        if not resp.healthy:
            return Probe(ProbeOutcome.NOT_SERVING)
        try:
            info = await self._info(timeout_s)
        except grpc.aio.AioRpcError as exc:
            return Probe(probe_outcome(exc.code()))
        return Probe(ProbeOutcome.OK, info)

    async def info(self, timeout_s: float = 5.0) -> WorkerInfo:
        """Query GetModelInfo and GetServerInfo.

        Raises:
            GatewayError(ENGINE_UNAVAILABLE | ENGINE_ERROR)
        """
        try:
            return await self._info(timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc) from None

    async def _info(self, timeout_s: float) -> WorkerInfo:
        model = await self._stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=timeout_s)
        server = await self._stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=timeout_s)
        self.last_answer = time.monotonic()
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
                self.last_answer = time.monotonic()
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
