"""Loopback workers of the SGLang and TokenSpeed wires that answer discovery only.

Each serves its engine's own gRPC service (``sglang.grpc.scheduler.SglangScheduler`` or
``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` of smg-grpc-proto) and implements what the
gateway asks when it registers a worker: ``HealthCheck``, ``GetModelInfo``, ``GetServerInfo``,
filled the way the real servicers fill them (smg-grpc-servicer 0.14.1: ``sglang/servicer.py``
``GetModelInfo`` / ``GetServerInfo`` put SGLang's ``ServerArgs`` in the ``server_args`` Struct;
``tokenspeed/servicer.py`` adds ``supported_modalities`` and ``multimodal_encoder_dtype`` to
``GetModelInfo`` and ``shm_namespace_id`` to ``scheduler_info``).  Every other method, ``Generate``
included, answers ``UNIMPLEMENTED`` (the generated base servicer's default; TokenSpeed's ``Generate``
counts the call first), so a test can see that nothing was sent.  ``calls`` counts each method called.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import (
    common_pb2,
    sglang_scheduler_pb2,
    sglang_scheduler_pb2_grpc,
    tokenspeed_scheduler_pb2,
    tokenspeed_scheduler_pb2_grpc,
)

MODEL_TYPE = "qwen2_5_vl"
_MODALITY = {"image": common_pb2.IMAGE, "video": common_pb2.VIDEO, "audio": common_pb2.AUDIO}


@dataclass
class FakeEngineState:
    """What a fake worker says about itself, and what it was asked."""

    healthy: bool = True
    supports_vision: bool = True
    model_type: str = MODEL_TYPE
    server_args: dict[str, Any] = field(default_factory=dict)  # merged over {"disaggregation_mode": "null"}
    supported_modalities: tuple[str, ...] = ("image", "video")  # TokenSpeed only
    encoder_dtype: str = "bfloat16"  # TokenSpeed only
    shm_namespace_id: str = ""  # TokenSpeed only (scheduler_info)
    calls: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def called(self, method: str) -> None:
        with self.lock:
            self.calls[method] += 1

    def args_struct(self) -> Struct:
        struct = Struct()
        struct.update({"disaggregation_mode": "null", "model_path": "fake", **self.server_args})
        return struct


class _Sglang(sglang_scheduler_pb2_grpc.SglangSchedulerServicer):
    def __init__(self, state: FakeEngineState) -> None:
        self.state = state

    def HealthCheck(self, request, context):
        self.state.called("HealthCheck")
        return sglang_scheduler_pb2.HealthCheckResponse(healthy=self.state.healthy, message="fake")

    def GetModelInfo(self, request, context):
        self.state.called("GetModelInfo")
        return sglang_scheduler_pb2.GetModelInfoResponse(
            model_path="fake", served_model_name="fake", is_generation=True, max_context_length=32768,
            vocab_size=151936, supports_vision=self.state.supports_vision, model_type=self.state.model_type,
            eos_token_ids=[151645])

    def GetServerInfo(self, request, context):
        self.state.called("GetServerInfo")
        return sglang_scheduler_pb2.GetServerInfoResponse(server_args=self.state.args_struct(), server_type="grpc",
                                                          sglang_version="fake")


class _TokenSpeed(tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerServicer):
    def __init__(self, state: FakeEngineState) -> None:
        self.state = state

    def HealthCheck(self, request, context):
        self.state.called("HealthCheck")
        return tokenspeed_scheduler_pb2.HealthCheckResponse(healthy=self.state.healthy, message="fake")

    def GetModelInfo(self, request, context):
        self.state.called("GetModelInfo")
        state = self.state
        modalities = [_MODALITY[m] for m in state.supported_modalities] if state.supports_vision else []
        return tokenspeed_scheduler_pb2.GetModelInfoResponse(
            model_path="fake", served_model_name="fake", model_type=state.model_type, max_context_length=32768,
            vocab_size=151936, eos_token_ids=[151645], supports_vision=state.supports_vision,
            supports_multimodal=bool(modalities), supported_modalities=modalities,
            model_dtype=state.encoder_dtype, multimodal_encoder_dtype=state.encoder_dtype)

    def GetServerInfo(self, request, context):
        self.state.called("GetServerInfo")
        scheduler = Struct()
        scheduler.update({"shm_namespace_id": self.state.shm_namespace_id})
        return tokenspeed_scheduler_pb2.GetServerInfoResponse(server_args=self.state.args_struct(),
                                                              scheduler_info=scheduler, tokenspeed_version="fake")

    def Generate(self, request, context):
        """Counted (``calls["Generate"]``), then ``UNIMPLEMENTED`` as the base servicer answers."""
        self.state.called("Generate")
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "fake: discovery only")
        yield from ()


_SERVICERS = {
    "sglang": (_Sglang, sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server),
    "tokenspeed": (_TokenSpeed, tokenspeed_scheduler_pb2_grpc.add_TokenSpeedSchedulerServicer_to_server),
}


class FakeEngine:
    """``FakeEngine("sglang" | "tokenspeed", state)``; ``.url`` is its grpc:// address; ``.stop()``.

    ``port``: listen there (0: any free port), e.g. to replace a stopped worker at the same address."""

    def __init__(self, wire: str, state: FakeEngineState | None = None, port: int = 0) -> None:
        self.wire = wire
        self.state = state or FakeEngineState()
        servicer, add = _SERVICERS[wire]
        # a receive limit as the fake vLLM worker's: a request with media reaches Generate (counted there)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                  options=[("grpc.max_receive_message_length", 512 * 1024 * 1024)])
        add(servicer(self.state), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=0)
