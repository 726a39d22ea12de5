"""The ``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` and ``tokenspeed.grpc.encoder.TokenSpeedEncoder``
servicers over the engine core.

Stage: engine (TokenSpeed wire).  In: ``tokenspeed_scheduler.proto`` / ``tokenspeed_encoder.proto``
requests, read by :mod:`.tokenspeed_inputs`; out: the scheduler's ``GenerateResponse`` stream
(:class:`~mmgate.refengine.streaming.TokenSpeedWriter`), ``EncodeResponse``, and the management
answers.

Roles, as smg-grpc-servicer 0.14.1 ``tokenspeed/server.py`` mounts them:
  * single / prefill / decode: the scheduler service.  PD legs carry ``kv_bootstrap_info`` (both
    legs the same: the prefill's bootstrap host and port, one room); a prefill or decode engine
    refuses a request without it.  An EPD prefill's items carry no ``encoder_input``; each is
    matched to its ``encode_bootstrap_info`` entry and its embeddings pulled from that encode
    engine (an item with neither is refused);
  * encode: the encoder service (``encoder_servicer.py`` ``Encode``: ``mm_inputs`` required,
    exactly one item and one room) plus a discovery-only scheduler service
    (``TokenSpeedEncodeDiscoveryServicer``: HealthCheck / GetModelInfo / GetServerInfo answered,
    Generate refused with FAILED_PRECONDITION).  The real servicer acknowledges an Encode once
    queued; the reference engine answers once the embeddings are published (or refuses the RPC
    with the tower's error, which the waiting prefill also receives).

Labels: GetModelInfo ``supported_modalities`` (``_static_supported_modalities``: image when the
model has a vision tower, video too when its config has ``video_token_id``, audio when it has an
audio tower and an audio token id), ``supports_vision``,
``supports_multimodal``, ``model_dtype`` float32, ``multimodal_encoder_dtype`` the engine's
``--advertised-encoder-dtype``; GetServerInfo ``server_args.disaggregation_mode`` ``null`` /
``prefill`` / ``decode`` / ``encode``, ``disaggregation_bootstrap_port``,
``scheduler_info.shm_namespace_id`` (the SHM tensor transport's namespace check).
``--language-model-only``: no supported modality (``_static_supported_modalities`` answers none when
the model's multimodal part is inactive), so ``supports_vision`` / ``supports_multimodal`` false; an
item with ``encoder_input`` is refused, a decode leg's items (identity, no encoder input) are taken.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import (
    common_pb2,
    tokenspeed_encoder_pb2,
    tokenspeed_encoder_pb2_grpc,
    tokenspeed_scheduler_pb2_grpc,
)
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

from mmgate.engines.base import Role
from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.core import EncodeLink, EngineCore, KvLink, Leg, Run
from mmgate.refengine.mm_inputs import check_ids
from mmgate.refengine.streaming import TokenSpeedWriter
from mmgate.refengine.tokenizer_bundle import ServesTokenizer, TokenizerBundle
from mmgate.refengine.tokenspeed_inputs import (
    encode_sources,
    item_batches,
    kv_bootstrap,
    read_items,
    sampling_params,
)
from mmgate.refengine.wire_base import (
    ENGINE_VERSION,
    TRANSFER_BACKEND,
    refuse,
    scheduler_loads,
    serve_generate,
)
from mmgate.transport.shm import shm_namespace_id

logger = logging.getLogger(__name__)

SERVICE_NAME = "tokenspeed.grpc.scheduler.TokenSpeedScheduler"
ENCODER_SERVICE_NAME = "tokenspeed.grpc.encoder.TokenSpeedEncoder"


def _invalid(message: str) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message)


class TokenSpeedServicer(ServesTokenizer, tokenspeed_scheduler_pb2_grpc.TokenSpeedSchedulerServicer):
    """The TokenSpeed scheduler wire over an :class:`EngineCore` (discovery only on an encode engine)."""

    def __init__(self, config: EngineConfig, core: EngineCore) -> None:
        self._config = config
        self._core = core
        self._start_time = time.time()
        self._tokenizer = TokenizerBundle(core.loaded.facts.model_path)

    def shutdown(self) -> None:
        self._core.shutdown()

    def GetLoads(self, request: pb.GetLoadsRequest, context: grpc.ServicerContext) -> pb.GetLoadsResponse:
        """The TokenSpeed ``GetLoads`` shape (:func:`~mmgate.refengine.wire_base.scheduler_loads`)."""
        return scheduler_loads(pb, self._core, self._config.model_workers)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        if self._config.role is Role.ENCODE:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "Generate is unavailable on TokenSpeed encode workers")

        def writer(run: Run) -> TokenSpeedWriter:
            return TokenSpeedWriter(request.request_id, request.stream, run.prompt_tokens, run.plan.logprobs or 0,
                                    request.sampling_params.no_stop_trim, run.plan.stop_token_ids)

        yield from serve_generate(self._core, request.request_id, context, lambda: self._read(request), writer)

    def _read(self, request: pb.GenerateRequest) -> Leg:
        if not request.HasField("tokenized"):
            raise _invalid("GenerateRequest.tokenized is required")
        if not request.tokenized.input_ids:
            raise _invalid("GenerateRequest.tokenized.input_ids is empty")
        facts, role = self._core.loaded.facts, self._config.role
        ids = check_ids(request.tokenized.input_ids, facts.vocab_size)
        items = read_items(request.mm_inputs, self._core.normalizer) if request.HasField("mm_inputs") else []
        if items and not facts.takes_media:
            raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, f"model {facts.model_type!r} takes no multimodal inputs")
        if items and self._config.language_model_only and (role is not Role.DECODE
                                                           or any(i.has_encoder_input for i in items)):
            raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                                   "this engine runs the language model only: it takes no multimodal items")
        sources = encode_sources(request, len(items))
        links = []
        for index, item in enumerate(items):
            source = sources.get(index)
            if source is not None and not item.has_encoder_input:
                links.append(EncodeLink(item.modality, source.host, source.port, source.room))
            elif not item.has_encoder_input and role is not Role.DECODE:
                raise _invalid(f"mm item {index} carries no encoder_input and no encode bootstrap")
        epd = bool(links)
        if epd and len(links) != len(items):
            raise _invalid("an EPD request's items must all come from encode workers")
        batches = item_batches(items, with_encoder_input=not epd) if role is not Role.DECODE else []
        link = None
        if role in (Role.PREFILL, Role.DECODE):
            boot = kv_bootstrap(request)
            if boot is None:
                raise _invalid(f"a {role.value} engine needs the request's kv_bootstrap_info")
            host, port, room = boot
            if role is Role.DECODE and (not host or not port):
                raise _invalid("kv_bootstrap_info lacks the prefill's bootstrap host or port")
            link = KvLink(host, port, str(room)) if role is Role.DECODE else KvLink(host, self._core.bootstrap_port,
                                                                                    str(room))
        return Leg(request.request_id, ids, batches, sampling_params(request), kv=link,
                   encode=tuple(links) if role is not Role.DECODE else ())

    def HealthCheck(self, request: pb.HealthCheckRequest, context: grpc.ServicerContext) -> pb.HealthCheckResponse:
        if self._core.shutting_down:
            return pb.HealthCheckResponse(healthy=False, message="Server is shutting down")
        if self._config.role is not Role.SINGLE:
            return pb.HealthCheckResponse(healthy=True,
                                          message="Health check passed (disaggregation worker; shallow probe)")
        return pb.HealthCheckResponse(healthy=True, message="Health check passed")

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        found = self._core.abort([request.request_id])
        return pb.AbortResponse(success=found > 0, message=(f"Aborted {found} request(s) for {request.request_id}"
                                                            if found else f"Request {request.request_id} not found"))

    def supported_modalities(self) -> list[int]:
        """``_static_supported_modalities``: image with a vision tower, video when the config has
        ``video_token_id``, audio when the model has an audio tower and an audio token id (the servicer's
        ``qwen3_omni*`` / generic branches; its ``qwen3_asr`` branch reads ``thinker_config.audio_config``,
        which a transformers-native flat Qwen3-ASR config lacks: the reference engine advertises AUDIO for
        the model it actually runs)."""
        facts = self._core.loaded.facts
        if not facts.takes_media or self._config.language_model_only:
            return []
        out = [common_pb2.IMAGE] if facts.supports_vision else []
        if facts.supports_vision and facts.video_token_id is not None:
            out.append(common_pb2.VIDEO)
        if facts.supports_audio:
            out.append(common_pb2.AUDIO)
        return out

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.GetModelInfoResponse:
        facts, modalities = self._core.loaded.facts, self.supported_modalities()
        return pb.GetModelInfoResponse(
            model_path=facts.model_path, tokenizer_path=facts.model_path, served_model_name=facts.served_model_name,
            model_type=facts.model_type, architectures=list(facts.architectures),
            max_context_length=facts.max_context_length, max_req_input_len=facts.max_context_length,
            vocab_size=facts.vocab_size, eos_token_ids=list(facts.eos_token_ids), pad_token_id=facts.pad_token_id,
            bos_token_id=facts.bos_token_id,
            supports_vision=any(m in (common_pb2.IMAGE, common_pb2.VIDEO) for m in modalities),
            supports_multimodal=bool(modalities), supported_modalities=modalities, model_dtype="float32",
            multimodal_encoder_dtype=self._config.encoder_dtype)

    def server_args(self) -> dict[str, Any]:
        """The ``server_args`` labels (TokenSpeed ``ServerArgs`` names)."""
        config, facts = self._config, self._core.loaded.facts
        mode = config.role.value if config.role is not Role.SINGLE else "null"
        return {"model": facts.model_path, "tokenizer": facts.model_path, "served_model_name": facts.served_model_name,
                "host": config.host, "port": config.port, "disaggregation_mode": mode,
                "disaggregation_bootstrap_port": self._core.bootstrap_port,
                "disaggregation_transfer_backend": TRANSFER_BACKEND if mode != "null" else "",
                "dtype": "float32", "max_running_requests": config.model_workers}

    def GetServerInfo(self, request: pb.GetServerInfoRequest,
                      context: grpc.ServicerContext) -> pb.GetServerInfoResponse:
        facts = self._core.loaded.facts
        args, scheduler = Struct(), Struct()
        args.update(self.server_args())
        scheduler.update({"max_total_num_tokens": facts.max_context_length,
                          "max_req_input_len": facts.max_context_length, "shm_namespace_id": shm_namespace_id()})
        start = Timestamp()
        start.FromSeconds(int(self._start_time))
        active, _ = self._core.counts()
        return pb.GetServerInfoResponse(
            server_args=args, scheduler_info=scheduler, active_requests=active, is_paused=False,
            uptime_seconds=time.time() - self._start_time, max_total_num_tokens=facts.max_context_length,
            tokenspeed_version=ENGINE_VERSION, start_time=start)


class TokenSpeedEncoderServicer(tokenspeed_encoder_pb2_grpc.TokenSpeedEncoderServicer):
    """``TokenSpeedEncoder.Encode`` on a ``--role encode`` engine."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    def Encode(self, request: tokenspeed_encoder_pb2.EncodeRequest,
               context: grpc.ServicerContext) -> tokenspeed_encoder_pb2.EncodeResponse:
        if not request.HasField("mm_inputs"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "EncodeRequest.mm_inputs is required")
        if len(request.mm_inputs.items) != 1 or len(request.items) != 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "EncodeRequest must contain exactly one mm item and one room assignment")
        room = int(request.items[0].bootstrap_room)
        try:
            (item,) = read_items(request.mm_inputs, self._core.normalizer, unspecified_is_image=True)
            if not item.has_encoder_input:
                raise _invalid("the encode item carries no encoder_input")
            self._core.encode([(item.as_batch(), item.embedding_rows, room)])
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            refuse(request.request_id, exc, context)
            raise AssertionError("unreachable") from None  # refuse aborted the RPC
        logger.info("EPD encode: published request_id=%s room=%s", request.request_id, room)
        return tokenspeed_encoder_pb2.EncodeResponse(accepted=True)
