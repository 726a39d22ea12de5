"""The ``sglang.grpc.scheduler.SglangScheduler`` servicer over the engine core.

Stage: engine (SGLang wire).  In: ``sglang_scheduler.proto`` requests; out: its
``GenerateResponse`` stream (:class:`~mmgate.refengine.streaming.SglangWriter`) and the
management answers (Generate, HealthCheck, Abort, GetModelInfo, GetServerInfo).

Reading mirrors smg-grpc-servicer 0.14.1 ``smg_grpc_servicer/sglang/servicer.py``:
  * ``_convert_generate_request``: ``tokenized`` required ("Tokenized input must be provided");
    ``disaggregated_params`` host (empty = none), port (0 = none), room (0 is a room);
    ``mm_inputs`` read only when ``pixel_values`` is set;
  * ``_parse_mm_inputs``: ONE image item: ``pixel_values`` (``tensor_wire.tensor_from_parts`` on
    the bare ``data`` bytes), every ``model_specific_tensors`` entry under its name,
    ``mm_placeholders`` as the item's offsets, ``im_token_id``; the reference engine hands the
    tensors to the model under their forward names, as the vLLM path does;
  * ``_convert_sampling_params``: ``top_p`` 0 -> 1.0, ``top_k`` 0 -> off, ``repetition_penalty``
    0 -> 1.0, ``max_new_tokens`` only when set, string-keyed ``logit_bias``, the constraint oneof
    (``ebnf_grammar`` -> grammar); ``temperature`` as sent (0 greedy); no seed on this wire;
    ``return_logprob`` + ``top_logprobs_num`` -> logprobs.
PD: a ``--role prefill`` engine keeps the KV under ``bootstrap_room`` on its own handoff
listener (the ``bootstrap_host`` / ``bootstrap_port`` the gateway sends are this engine's, from
its ``disaggregation_bootstrap_port`` label); a ``--role decode`` engine pulls it from there.
Both refuse a request without ``disaggregated_params``.

Labels (GetServerInfo ``server_args``, as SGLang's ``ServerArgs`` names them):
``disaggregation_mode`` ``null`` / ``prefill`` / ``decode``, ``disaggregation_bootstrap_port``,
``disaggregation_transfer_backend`` (the reference engine's own handoff), ``encoder_only`` false,
``language_only`` true only with ``--language-model-only`` (SGLang's language-only worker, which
takes a request's embeddings from an encoder instead of running the tower: the reference engine
refuses ``pixel_values`` then; ``supports_vision`` stays the model's, as SGLang reports
``model.is_multimodal``); ``server_type`` ``grpc``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc, vllm_engine_pb2

from mmgate.engines.base import Role
from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.core import EngineCore, KvLink, Leg, Run
from mmgate.refengine.device_normalize import DeviceNormalizer
from mmgate.refengine.mm_inputs import (
    DEFAULT_ENCODER_INPUT_KEY,
    MediaBatch,
    check_ids,
    finish_tensors,
)
from mmgate.refengine.streaming import SglangWriter
from mmgate.refengine.tensors import tensor_from_bytes
from mmgate.refengine.tokenizer_bundle import ServesTokenizer, TokenizerBundle
from mmgate.refengine.wire_base import (
    ENGINE_VERSION,
    TRANSFER_BACKEND,
    advertised_host,
    scheduler_loads,
    serve_generate,
)
from mmgate.types import Modality

logger = logging.getLogger(__name__)

SERVICE_NAME = "sglang.grpc.scheduler.SglangScheduler"


def _invalid(message: str) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message)


def sampling_params(request: pb.GenerateRequest) -> vllm_engine_pb2.SamplingParams:
    """The request's sampling fields in the engine's schema (see the module docstring)."""
    p = request.sampling_params
    out = vllm_engine_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p if p.top_p != 0.0 else 1.0, top_k=max(p.top_k, 0),
        min_p=p.min_p, frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0.0 else 1.0,
        min_tokens=p.min_new_tokens, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens, n=p.n or 1,
        include_stop_str_in_output=p.no_stop_trim)
    if p.HasField("max_new_tokens"):
        out.max_tokens = p.max_new_tokens
    try:
        out.logit_bias.update({int(k): v for k, v in p.logit_bias.items()})
    except ValueError:
        raise _invalid("logit_bias keys must be token ids") from None
    which = p.WhichOneof("constraint")
    if which == "ebnf_grammar":
        out.grammar = p.ebnf_grammar
    elif which is not None:
        setattr(out, which, getattr(p, which))
    if request.return_logprob:
        out.logprobs = max(request.top_logprobs_num, 0)
    return out


def image_batch(mm: pb.MultimodalInputs, normalizer: DeviceNormalizer | None = None) -> MediaBatch:
    """``_parse_mm_inputs``: the one image item's tensors under their forward names."""
    tensors = {DEFAULT_ENCODER_INPUT_KEY: tensor_from_bytes(mm.pixel_values.data, mm.pixel_values.shape,
                                                            mm.pixel_values.dtype)}
    for key, td in mm.model_specific_tensors.items():
        tensors[key] = tensor_from_bytes(td.data, td.shape, td.dtype)
    if not mm.mm_placeholders:
        logger.warning("No mm_placeholders from the gateway: the image's embedding positions are unknown")
    return MediaBatch(Modality.IMAGE, finish_tensors(tensors, DEFAULT_ENCODER_INPUT_KEY, normalizer),
                      DEFAULT_ENCODER_INPUT_KEY)


class SglangServicer(ServesTokenizer, sglang_scheduler_pb2_grpc.SglangSchedulerServicer):
    """The SGLang wire over an :class:`EngineCore`."""

    def __init__(self, config: EngineConfig, core: EngineCore) -> None:
        self._config = config
        self._core = core
        self._start_time = time.time()
        self._tokenizer = TokenizerBundle(core.loaded.facts.model_path)

    def shutdown(self) -> None:
        self._core.shutdown()

    def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.ServicerContext) -> pb.GetLoadsResponse:
        """The SGLang ``GetLoads`` shape (:func:`~mmgate.refengine.wire_base.scheduler_loads`)."""
        return scheduler_loads(pb, self._core, self._config.model_workers)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        def writer(run: Run) -> SglangWriter:
            return SglangWriter(request.request_id, request.stream, run.prompt_tokens, run.plan.logprobs or 0)

        yield from serve_generate(self._core, request.request_id, context, lambda: self._read(request), writer)

    def _read(self, request: pb.GenerateRequest) -> Leg:
        if not request.HasField("tokenized"):
            raise _invalid("Tokenized input must be provided")
        facts = self._core.loaded.facts
        ids = check_ids(request.tokenized.input_ids, facts.vocab_size)
        batches = []
        if request.HasField("mm_inputs") and request.mm_inputs.HasField("pixel_values"):
            if self._config.language_model_only:
                raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                                   "this engine runs the language model only (language_only): it takes no pixels")
            if not facts.supports_vision:
                raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                                   f"model {facts.model_type!r} takes no multimodal inputs")
            batches.append(image_batch(request.mm_inputs, self._core.normalizer))
        role, link = self._config.role, None
        if role in (Role.PREFILL, Role.DECODE):
            if not request.HasField("disaggregated_params"):
                raise _invalid(f"a {role.value} engine needs the request's disaggregated_params "
                               "(bootstrap host, port, room)")
            d = request.disaggregated_params
            if role is Role.PREFILL:
                link = KvLink(advertised_host(self._config.host), self._core.bootstrap_port, str(d.bootstrap_room))
            else:
                if not d.bootstrap_host or not d.bootstrap_port:
                    raise _invalid("disaggregated_params lack the prefill's bootstrap host or port")
                link = KvLink(d.bootstrap_host, d.bootstrap_port, str(d.bootstrap_room))
        return Leg(request.request_id, ids, batches, sampling_params(request), kv=link)

    def HealthCheck(self, request: pb.HealthCheckRequest, context: grpc.ServicerContext) -> pb.HealthCheckResponse:
        if self._core.shutting_down:
            return pb.HealthCheckResponse(healthy=False, message="Server is shutting down")
        return pb.HealthCheckResponse(healthy=True, message="Health check passed")

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        found = self._core.abort([request.request_id]) > 0
        return pb.AbortResponse(success=found,
                                message=f"Request {request.request_id} {'aborted' if found else 'not found'}")

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.GetModelInfoResponse:
        facts = self._core.loaded.facts
        return pb.GetModelInfoResponse(
            model_path=facts.model_path, tokenizer_path=facts.model_path, is_generation=True,
            served_model_name=facts.served_model_name, max_context_length=facts.max_context_length,
            vocab_size=facts.vocab_size, supports_vision=facts.supports_vision, model_type=facts.model_type,
            architectures=list(facts.architectures), eos_token_ids=list(facts.eos_token_ids),
            pad_token_id=facts.pad_token_id, bos_token_id=facts.bos_token_id,
            max_req_input_len=facts.max_context_length)

    def server_args(self) -> dict[str, Any]:
        """The ``server_args`` labels (SGLang ``ServerArgs`` names)."""
        config, facts = self._config, self._core.loaded.facts
        mode = config.role.value if config.role in (Role.PREFILL, Role.DECODE) else "null"
        return {
            "model_path": facts.model_path, "tokenizer_path": facts.model_path,
            "served_model_name": facts.served_model_name, "host": config.host, "port": config.port,
            "disaggregation_mode": mode, "disaggregation_bootstrap_port": self._core.bootstrap_port,
            "disaggregation_transfer_backend": TRANSFER_BACKEND if mode != "null" else "",
            "encoder_only": False, "language_only": config.language_model_only, "dtype": "float32", "skip_tokenizer_init": True,
            "context_length": facts.max_context_length, "max_running_requests": config.model_workers,
        }

    def GetServerInfo(self, request: pb.GetServerInfoRequest,
                      context: grpc.ServicerContext) -> pb.GetServerInfoResponse:
        facts = self._core.loaded.facts
        args, scheduler = Struct(), Struct()
        args.update(self.server_args())
        scheduler.update({"is_generation": True, "max_req_input_len": facts.max_context_length,
                          "max_total_num_tokens": facts.max_context_length})
        start = Timestamp()
        start.FromSeconds(int(self._start_time))
        active, _ = self._core.counts()
        return pb.GetServerInfoResponse(
            server_args=args, scheduler_info=scheduler, active_requests=active, is_paused=False,
            last_receive_timestamp=self._core.last_receive, uptime_seconds=time.time() - self._start_time,
            sglang_version=ENGINE_VERSION, server_type="grpc", start_time=start,
            max_total_num_tokens=facts.max_context_length)
