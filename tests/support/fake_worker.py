"""A real gRPC vLLM-wire worker on loopback for gateway tests: no model, configurable delay.

It answers HealthCheck / GetModelInfo / GetServerInfo with the labels a test
asks for, and Generate with one token after ``delay_s`` (streamed: the chunk, then
the completion ``stream_pause_s`` later).  Every request's
tensors are decoded by the real servicer's code (smg-grpc-servicer 0.14.1
``vllm/mm_tensors.py`` ``tensor_from_proto``: shared memory read, then unlinked; a
dtype outside ``tensor_wire.PROTO_DTYPE_MAP`` or a wrong byte count refused with
INVALID_ARGUMENT, as the servicer refuses its ``ValueError``) and kept in
``received``, with its sampling parameters, for the test to compare.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from tests.support.servicer_code import tensor_from_proto, to_numpy


@dataclass
class Received:
    input_ids: list[int]
    tensors: dict[str, np.ndarray]  # name -> array as the servicer decodes it (bf16 as uint16 bits)
    dtypes: dict[str, str]
    payloads: dict[str, str]  # name -> "inline" | "shm"
    sampling: vllm_engine_pb2.SamplingParams | None = None  # the request's sampling_params as received
    request: vllm_engine_pb2.GenerateRequest | None = None  # the whole request as received (inline tensors readable)


@dataclass
class FakeWorkerState:
    delay_s: float = 0.0
    stream_pause_s: float = 0.0  # a streamed answer: seconds between its chunk and its completion
    fail_with: grpc.StatusCode | None = None
    model_type: str = "qwen2_vl"
    supports_vision: bool = True
    labels: dict[str, object] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: GetLoads answers with these ``SchedulerLoad`` fields (None: GetLoads is UNIMPLEMENTED)
    load: dict[str, float] | None = None
    #: SubscribeKvEvents streams what is put here (``common_pb2.KvEventBatch``; None ends the stream); with
    #: ``kv_events`` False it is UNIMPLEMENTED
    kv_events: bool = False
    kv_batches: queue.Queue[object] = field(default_factory=queue.Queue)


def _decode(td: vllm_engine_pb2.TensorData) -> np.ndarray:
    return to_numpy(tensor_from_proto(td))


class _Servicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, state: FakeWorkerState) -> None:
        self.state = state

    def HealthCheck(self, request, context):  # noqa: N802 - gRPC API
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="ok")

    def GetModelInfo(self, request, context):  # noqa: N802
        return vllm_engine_pb2.GetModelInfoResponse(model_path="fake", served_model_name="fake", is_generation=True,
                                                    max_context_length=32768, vocab_size=151936,
                                                    supports_vision=self.state.supports_vision,
                                                    model_type=self.state.model_type, eos_token_ids=[151645])

    def GetServerInfo(self, request, context):  # noqa: N802
        return vllm_engine_pb2.GetServerInfoResponse(server_type="vllm-grpc", **self.state.labels)

    def GetLoads(self, request, context):  # noqa: N802
        if self.state.load is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no loads")
        return vllm_engine_pb2.GetLoadsResponse(dp_rank_count=1, loads=[vllm_engine_pb2.SchedulerLoad(
            dp_rank=0, **self.state.load)])

    def SubscribeKvEvents(self, request, context):  # noqa: N802
        if not self.state.kv_events:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no KV events")
        while context.is_active():
            try:
                batch = self.state.kv_batches.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            yield batch

    def Generate(self, request, context):  # noqa: N802
        tensors: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        payloads: dict[str, str] = {}
        batches = ([request.mm_inputs] if request.HasField("mm_inputs") else []) + list(request.extra_mm_inputs)
        for mm in batches:
            named = [("pixel_values", mm.pixel_values)] if mm.HasField("pixel_values") else []
            named += list(mm.model_specific_tensors.items())
            for name, td in named:
                try:
                    tensors[name] = _decode(td)
                except ValueError as exc:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                dtypes[name] = td.dtype
                payloads[name] = td.WhichOneof("payload")
        with self.state.lock:
            self.state.received.append(Received(list(request.tokenized.input_ids), tensors, dtypes, payloads,
                                                sampling=request.sampling_params, request=request))
        if self.state.delay_s:
            time.sleep(self.state.delay_s)
        if self.state.fail_with is not None:
            context.abort(self.state.fail_with, "fake worker failure")
        n = len(request.tokenized.input_ids)
        if request.stream:
            yield vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
                token_ids=[9707], prompt_tokens=n, completion_tokens=1))
            if self.state.stream_pause_s:
                time.sleep(self.state.stream_pause_s)
        yield vllm_engine_pb2.GenerateResponse(complete=vllm_engine_pb2.GenerateComplete(
            output_ids=[9707], finish_reason="stop", prompt_tokens=n, completion_tokens=1))


class FakeWorker:
    """Start with ``FakeWorker(state)``; ``.url`` is its grpc:// address; ``.stop()``."""

    def __init__(self, state: FakeWorkerState | None = None) -> None:
        self.state = state or FakeWorkerState()
        # grpc.so_reuseport off: with it (grpc's default) port 0 may be a port another process's gRPC server
        # already listens on, and the kernel then splits this worker's connections between the two
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                                  options=[("grpc.max_receive_message_length", 512 * 1024 * 1024),
                                           ("grpc.so_reuseport", 0)])
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(_Servicer(self.state), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=0)
