"""A recording SGLang scheduler on loopback: ``sglang.grpc.scheduler.SglangScheduler``, no model.

Written from ``smg_grpc_proto`` ``sglang_scheduler.proto`` (0.4) and the reading code of the real
servicer (smg-grpc-servicer 0.14.1, unpacked at ``/tmp/smgs/x/smg_grpc_servicer``), ported so a
test sees what the SGLang scheduler would be handed:

* tensors are decoded by the installed servicer's own ``tensor_wire.tensor_from_parts``
  (:mod:`tests.support.servicer_code`; re-exported here with ``PROTO_DTYPE_MAP``): its dtype
  table and byte-count check, not a copy of them;
* ``sglang/servicer.py`` ``_convert_generate_request`` (l.939-1010): ``tokenized`` required,
  the bootstrap fields (an empty host or port read as None, the room as it is), ``mm_inputs``
  parsed only when ``pixel_values`` is set, ``logprob_start_len`` / ``top_logprobs_num``;
* ``_parse_mm_inputs`` (l.1017-1049): one item, ``Modality.IMAGE``, ``feature`` = the decoded
  ``pixel_values``, ``model_specific_data`` = the decoded ``model_specific_tensors``,
  ``offsets`` = ``(offset, offset + length - 1)`` per ``mm_placeholders`` entry (None when
  there is none), ``im_token_id`` when present;
* ``_convert_sampling_params`` (l.1081-1153): the keyword arguments of SGLang's
  ``SamplingParams`` (the zero-means-unset rules for ``top_p``, ``top_k``,
  ``repetition_penalty``; ``custom_params`` as a dict);
* ``_create_chunk_response`` / ``_create_completion_response`` (l.1230-1321) for the answer.

A request the servicer would refuse with its ``ValueError`` is aborted with INVALID_ARGUMENT, as
the servicer does (l.305-307); request id ``too-long`` is refused as SGLang's scheduler refuses
an over-long prompt (``managers/utils.py`` ``validate_input_length``).
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.support.servicer_code import PROTO_DTYPE_MAP, sglang_tensor, tensor_from_parts  # noqa: F401 - re-exported

#: the tokens every answer generates
ANSWER = (101, 102, 103)


@dataclass
class MultimodalItem:
    """``MultimodalDataItem`` + ``MultimodalProcessorOutput.im_token_id`` as ``_parse_mm_inputs`` builds them."""

    modality: str
    feature: torch.Tensor
    model_specific_data: dict[str, torch.Tensor]
    offsets: list[tuple[int, int]] | None
    im_token_id: int | None


@dataclass
class Received:
    """One Generate request as the servicer hands it to SGLang (``TokenizedGenerateReqInput``)."""

    message: pb.GenerateRequest
    input_text: str
    input_ids: list[int]
    sampling: dict[str, Any]
    mm: MultimodalItem | None
    bootstrap_host: str | None
    bootstrap_port: int | None
    bootstrap_room: int | None
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    stream: bool


def convert_sampling_params(p: pb.SamplingParams) -> dict[str, Any]:
    """``_convert_sampling_params``: the keyword arguments of SGLang's ``SamplingParams``."""
    constraint = {"regex": None, "json_schema": None, "ebnf": None, "structural_tag": None}
    for field_name, key in (("regex", "regex"), ("json_schema", "json_schema"), ("ebnf_grammar", "ebnf"),
                            ("structural_tag", "structural_tag")):
        if p.HasField(field_name):
            constraint[key] = getattr(p, field_name)
            break
    return {
        "temperature": p.temperature, "top_p": p.top_p if p.top_p != 0.0 else 1.0,
        "top_k": p.top_k if p.top_k != 0 else -1, "min_p": p.min_p,
        "frequency_penalty": p.frequency_penalty, "presence_penalty": p.presence_penalty,
        "repetition_penalty": p.repetition_penalty if p.repetition_penalty != 0.0 else 1.0,
        "max_new_tokens": p.max_new_tokens if p.HasField("max_new_tokens") else None,
        "min_new_tokens": p.min_new_tokens, "stop": list(p.stop) if p.stop else None,
        "stop_token_ids": list(p.stop_token_ids) if p.stop_token_ids else None,
        "skip_special_tokens": p.skip_special_tokens,
        "spaces_between_special_tokens": p.spaces_between_special_tokens, "no_stop_trim": p.no_stop_trim,
        **constraint, "n": p.n, "ignore_eos": p.ignore_eos,
        "stream_interval": p.stream_interval if p.HasField("stream_interval") else None,
        "logit_bias": dict(p.logit_bias) if p.logit_bias else None,
        "custom_params": MessageToDict(p.custom_params) if p.HasField("custom_params") else None,
    }


def parse_mm_inputs(mm: pb.MultimodalInputs) -> MultimodalItem:
    """``_parse_mm_inputs``."""
    feature = sglang_tensor(mm.pixel_values)
    specific = {k: sglang_tensor(t) for k, t in mm.model_specific_tensors.items()}
    offsets = [(p.offset, p.offset + p.length - 1) for p in mm.mm_placeholders] or None
    return MultimodalItem(modality="IMAGE", feature=feature, model_specific_data=specific, offsets=offsets,
                          im_token_id=mm.im_token_id if mm.HasField("im_token_id") else None)


def convert_generate_request(req: pb.GenerateRequest) -> Received:
    """``_convert_generate_request``."""
    if not req.HasField("tokenized"):
        raise ValueError("Tokenized input must be provided")
    host = port = room = None
    if req.HasField("disaggregated_params"):
        d = req.disaggregated_params
        host, port, room = d.bootstrap_host or None, d.bootstrap_port or None, d.bootstrap_room
    mm = parse_mm_inputs(req.mm_inputs) if req.HasField("mm_inputs") and req.mm_inputs.HasField("pixel_values") \
        else None
    return Received(message=req, input_text=req.tokenized.original_text, input_ids=list(req.tokenized.input_ids),
                    sampling=convert_sampling_params(req.sampling_params), mm=mm, bootstrap_host=host,
                    bootstrap_port=port, bootstrap_room=room, return_logprob=req.return_logprob,
                    logprob_start_len=req.logprob_start_len, top_logprobs_num=req.top_logprobs_num or 0,
                    stream=req.stream)


def _logprobs(tokens: tuple[int, ...], top: int) -> pb.OutputLogProbs:
    return pb.OutputLogProbs(
        token_logprobs=[-0.5] * len(tokens), token_ids=list(tokens),
        top_logprobs=[pb.TopLogProbs(values=[-0.5 - k for k in range(top)], token_ids=[t + k for k in range(top)])
                      for t in tokens])


@dataclass
class RecordingScheduler(pb_grpc.SglangSchedulerServicer):
    """Records every Generate request (raw and converted) and answers :data:`ANSWER` per choice."""

    model_type: str = "qwen2_5_vl"
    disaggregation_mode: str = "null"
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        try:
            got = convert_generate_request(request)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with self.lock:
            self.received.append(got)
        if request.request_id == "too-long":
            n = len(got.input_ids)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"Input length ({n} tokens) exceeds the maximum allowed length ({n - 1} tokens). "
                          "Use a shorter input or enable --allow-auto-truncate.")
        stop = got.sampling["stop_token_ids"]
        tokens = ANSWER[:-1] + (stop[0],) if stop else ANSWER
        top = got.top_logprobs_num if got.return_logprob else 0
        for index in range(max(got.sampling["n"], 1)):
            lp = _logprobs(tokens, top) if got.return_logprob else None
            counts = {"prompt_tokens": len(got.input_ids), "cached_tokens": 0}
            if request.stream:
                for i, token in enumerate(tokens):
                    yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.GenerateStreamChunk(
                        token_ids=[token], completion_tokens=i + 1, index=index,
                        output_logprobs=_logprobs((token,), top) if lp is not None else None, **counts))
            matched = {"matched_token_id": stop[0]} if stop else {}
            # streamed: the completion repeats the last output's tokens (request_manager: the finished
            # output, l.295-298); otherwise all of them (request_manager ``state.output_ids``)
            final = tokens[-1:] if request.stream else tokens
            yield pb.GenerateResponse(request_id=request.request_id, complete=pb.GenerateComplete(
                output_ids=list(final), finish_reason="stop" if stop else "length", completion_tokens=len(tokens),
                output_logprobs=_logprobs(final, top) if lp is not None else None, index=index, **counts,
                **matched))

    def HealthCheck(self, request: pb.HealthCheckRequest, context: grpc.ServicerContext):
        return pb.HealthCheckResponse(healthy=True, message="Health check passed")

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext):
        return pb.GetModelInfoResponse(model_path="fake", is_generation=True, max_context_length=32768,
                                       vocab_size=151936, supports_vision=True, model_type=self.model_type,
                                       eos_token_ids=[151645], max_req_input_len=32767)

    def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.ServicerContext):
        args = Struct()
        args.update({"model_path": "fake", "disaggregation_mode": self.disaggregation_mode,
                     "disaggregation_bootstrap_port": 8998})
        return pb.GetServerInfoResponse(server_args=args, sglang_version="fake", server_type="grpc")


@dataclass
class FakeWorker:
    """A started :class:`RecordingScheduler` and a channel to it."""

    scheduler: RecordingScheduler
    server: grpc.Server
    channel: grpc.Channel
    target: str

    @property
    def stub(self) -> pb_grpc.SglangSchedulerStub:
        return pb_grpc.SglangSchedulerStub(self.channel)

    def generate_bytes(self, data: bytes) -> list[pb.GenerateResponse]:
        """Generate with a pre-serialized request (what a client sends for ``encode_generate_request``)."""
        call = self.channel.unary_stream("/sglang.grpc.scheduler.SglangScheduler/Generate",
                                         request_serializer=None,
                                         response_deserializer=pb.GenerateResponse.FromString)
        return list(call(data))

    def close(self) -> None:
        self.channel.close()
        self.server.stop(None)


_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]


def start(scheduler: RecordingScheduler | None = None) -> FakeWorker:
    """Serve ``scheduler`` on ``127.0.0.1:<free port>``."""
    scheduler = scheduler or RecordingScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=_OPTIONS)
    pb_grpc.add_SglangSchedulerServicer_to_server(scheduler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    target = f"127.0.0.1:{port}"
    return FakeWorker(scheduler, server, grpc.insecure_channel(target, options=_OPTIONS), target)
