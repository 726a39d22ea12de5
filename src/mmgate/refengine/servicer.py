"""The ``vllm.grpc.engine.VllmEngine`` servicer over the engine core.

Stage: engine (vLLM wire).  In: gRPC requests from a gateway; out: streamed
``GenerateResponse`` messages (:class:`~mmgate.refengine.streaming.VllmWriter`) and the
management answers.

Reading follows ``smg_grpc_servicer/vllm/servicer.py`` (smg-grpc-servicer 0.14.1):
``tokenized`` ids or ``text``; the batches by :func:`~mmgate.refengine.mm_inputs.vllm_batches`;
worker-side ``media_refs`` resolved first (:mod:`.mm_processor`); ``kv_transfer_params_json``
(else the legacy typed field) by ``kv_transfer.params_from_request``.  PD on this wire:

  * a ``--role prefill`` engine (``kv_role`` ``kv_producer``) given ``do_remote_decode`` runs the
    prompt, keeps its KV for the decode engine under the room ``remote_request_id`` (its request
    id) and answers a ``GenerateComplete`` with each choice's first token and
    ``kv_transfer_params_json`` = ``{"do_remote_prefill": true, "do_remote_decode": false,
    "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids": [],
    "tp_size": 1}`` (the NixlConnector ``request_finished`` shape; ``remote_port`` is this engine's
    ``--bootstrap-port``).  Without ``do_remote_decode`` it serves the request whole, as vLLM;
  * a ``--role decode`` engine (``kv_consumer``) given those params pulls the KV from
    ``remote_host:remote_port`` and continues; a pixel-less multimodal payload (the decode leg's
    form: hashes, placeholders, grids) without them is refused, as the servicer refuses it
    ("a pixel-less leg requires remote KV").

``--language-model-only`` (vLLM ``--language-model-only``): GetModelInfo ``supports_vision`` false
(the servicer reports vLLM's ``engine_accepts_mm_inputs``, ``vllm/mm_salt.py``), no worker-side
media labels; a batch carrying any tensor is refused, a batch of hashes and placeholders only (the
identity a gateway sends such a decode worker) is read as the servicer reads it, as no media: its
hashes only salt the prefix cache (``mm_identity_cache_salt``), which the reference engine has not.

Everything else (threads, errors): :mod:`.core` and :mod:`.wire_base`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from mmgate.engines.base import Role
from mmgate.errors import ErrorCode, GatewayError
from mmgate.refengine.bundle import LoadedModel
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.core import (
    MANAGEMENT_THREADS,
    EngineCore,
    KvLink,
    Leg,
    Run,
    grpc_status,
)
from mmgate.refengine import frames_as_images
from mmgate.refengine.device_normalize import DeviceNormalizer
from mmgate.refengine.mm_inputs import mm_batches, prompt_ids, refuse_audio_batches, vllm_batches
from mmgate.refengine.mm_processor import WorkerMedia
from mmgate.refengine.streaming import VllmWriter
from mmgate.refengine.tokenizer_bundle import ServesTokenizer, TokenizerBundle
from mmgate.refengine.wire_base import TRANSFER_BACKEND, advertised_host, serve_generate
from mmgate.transport.shm import shm_namespace_id

logger = logging.getLogger(__name__)

SERVER_TYPE = "vllm-grpc"
SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
_KV_ROLE = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}
__all__ = ["MANAGEMENT_THREADS", "SERVER_TYPE", "RefEngineServicer", "device_normalizer", "grpc_status"]


def device_normalizer(config: EngineConfig, loaded: LoadedModel) -> DeviceNormalizer | None:
    """The engine's uint8 normalizer: only with ``--mm-device-do-normalize`` and a family whose raw
    layout the engine knows (``EngineFamily.raw_layout``); GetServerInfo advertises
    ``mm_device_do_normalize`` exactly when there is one.
    """
    if not config.device_normalize:
        return None
    layout = loaded.family.raw_layout
    if layout is None or not loaded.facts.supports_vision:
        logger.warning("--mm-device-do-normalize ignored: the engine knows no raw pixel layout for %s",
                       loaded.facts.model_type)
        return None
    return DeviceNormalizer.from_bundle(config.model, layout)


def kv_transfer_params(request: vllm_engine_pb2.GenerateRequest) -> dict[str, Any] | None:
    """``smg_grpc_servicer/vllm/kv_transfer.py`` ``params_from_request``: the JSON field first, then the
    legacy typed one.

    Raises:
        GatewayError(INVALID_REQUEST): malformed JSON, not an object, or an invalid legacy field.
    """
    if request.HasField("kv_transfer_params_json"):
        try:
            params = json.loads(request.kv_transfer_params_json)
        except json.JSONDecodeError as exc:
            raise GatewayError(ErrorCode.INVALID_REQUEST, f"Invalid kv_transfer_params_json: {exc}") from None
        if not isinstance(params, dict):
            raise GatewayError(ErrorCode.INVALID_REQUEST, "kv_transfer_params_json must be a JSON object")
        return params
    if request.HasField("kv_transfer_params"):
        host, port = request.kv_transfer_params.remote_host, request.kv_transfer_params.remote_port
        if not host or not 1 <= port <= 65535:
            raise GatewayError(ErrorCode.INVALID_REQUEST, "Invalid kv_transfer_params: remote_host must be set "
                                                          "and remote_port must be in [1, 65535].")
        return {"remote_host": host, "remote_port": port}
    return None


class RefEngineServicer(ServesTokenizer, vllm_engine_pb2_grpc.VllmEngineServicer):
    """The vLLM wire over an :class:`EngineCore`."""

    def __init__(self, config: EngineConfig, core: EngineCore) -> None:
        self._config = config
        self._core = core
        self._loaded = core.loaded
        self._media = WorkerMedia(config.mm, config.model)
        self._engine_id = f"refengine-{uuid.uuid4().hex[:12]}"
        self._tokenizer = TokenizerBundle(self._loaded.facts.model_path)

    def shutdown(self) -> None:
        """Cancel in-flight requests and stop the model thread."""
        self._core.shutdown()
        self._media.close()

    # ---- Generate ---------------------------------------------------------------------------------

    def Generate(
        self, request: vllm_engine_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[vllm_engine_pb2.GenerateResponse]:
        kv_out: list[str] = []

        def read() -> Leg:
            return self._read(request, context, kv_out)

        def writer(run: Run) -> VllmWriter:
            return VllmWriter(request.request_id, request.stream, run.prompt_tokens, run.plan.logprobs or 0,
                              kv_out[0] if kv_out else None)

        yield from serve_generate(self._core, request.request_id, context, read, writer)

    def _read(self, request: vllm_engine_pb2.GenerateRequest, context: grpc.ServicerContext,
              kv_out: list[str]) -> Leg:
        refuse_audio_batches(request)  # the wire carries no preprocessed audio (a clear refusal up front)
        request = self._media.resolve(request, context.time_remaining())
        facts = self._loaded.facts
        if request.HasField("media_refs") and request.media_refs.items:
            raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, "this engine does not process media references")
        video_as_images = self._loaded.family.video_as_images and facts.image_token_id is not None
        if video_as_images:  # InternVL3: vLLM's <video> context ids read as the image token
            request = frames_as_images.rewrite_ids(request, int(facts.image_token_id))  # type: ignore[arg-type]
        ids = prompt_ids(request, self._core.tokenizer, facts.vocab_size)
        # ``has_preprocessed_mm_payload``: a batch without any tensor is bare identity (the cache-salt path)
        preprocessed = [mm for mm in mm_batches(request) if mm.HasField("pixel_values") or mm.model_specific_tensors]
        if preprocessed and self._config.language_model_only:
            raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                               "this engine runs the language model only (--language-model-only): it takes no "
                               "multimodal tensors")
        if mm_batches(request) and not facts.supports_vision:
            raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, f"model {facts.model_type!r} takes no multimodal inputs")
        bare = len(preprocessed) < len(mm_batches(request))
        batches = vllm_batches(request, self._core.normalizer) if preprocessed else []
        if video_as_images:
            batches = frames_as_images.merge_batches(request, batches)
        params = kv_transfer_params(request)
        role, link = self._config.role, None
        if role is Role.DECODE and params is not None and params.get("do_remote_prefill"):
            try:
                link = KvLink(str(params["remote_host"]), int(params["remote_port"]),
                              str(params.get("remote_request_id") or request.request_id))
            except (KeyError, TypeError, ValueError):
                raise GatewayError(ErrorCode.INVALID_REQUEST, "kv_transfer_params lack remote_host / "
                                                              "remote_port") from None
        elif role is Role.PREFILL and params is not None and params.get("do_remote_decode"):
            link = KvLink(advertised_host(self._config.host), self._core.bootstrap_port, request.request_id)
            kv_out.append(json.dumps({
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [],
                "remote_engine_id": self._engine_id, "remote_request_id": request.request_id,
                "remote_host": link.host, "remote_port": link.port, "tp_size": 1}))
        if link is None and (any(b.primary not in b.tensors for b in batches)
                             or (bare and not self._config.language_model_only)):
            # (a bare identity on a full engine would be served as text by the servicer; the reference
            # engine refuses it as it refuses a pixel-less payload: nothing embeds its placeholders)
            raise GatewayError(ErrorCode.INVALID_REQUEST,
                               "multimodal payload carries grid tensors but no pixel_values and no "
                               "kv_transfer_params; a pixel-less leg requires remote KV")
        return Leg(request.request_id, ids, batches, request.sampling_params, kv=link)

    # ---- management -------------------------------------------------------------------------------

    def HealthCheck(
        self, request: vllm_engine_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> vllm_engine_pb2.HealthCheckResponse:
        if self._core.shutting_down:
            return vllm_engine_pb2.HealthCheckResponse(healthy=False, message="Server is shutting down")
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="Health")

    def Abort(
        self, request: vllm_engine_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> vllm_engine_pb2.AbortResponse:
        found = self._core.abort(list(request.request_ids))
        logger.info("abort %s (%d running)", list(request.request_ids), found)
        return vllm_engine_pb2.AbortResponse()

    def GetModelInfo(
        self, request: vllm_engine_pb2.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> vllm_engine_pb2.GetModelInfoResponse:
        facts = self._loaded.facts
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path=facts.model_path,
            is_generation=True,
            max_context_length=facts.max_context_length,
            vocab_size=facts.vocab_size,
            supports_vision=facts.supports_vision and not self._config.language_model_only,
            served_model_name=facts.served_model_name,
            tokenizer_path=facts.model_path,
            model_type=facts.model_type,
            architectures=list(facts.architectures),
            eos_token_ids=list(facts.eos_token_ids),
            pad_token_id=facts.pad_token_id,
            bos_token_id=facts.bos_token_id,
            max_req_input_len=facts.max_context_length,
        )

    def GetServerInfo(
        self, request: vllm_engine_pb2.GetServerInfoRequest, context: grpc.ServicerContext
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        active, _ = self._core.counts()
        mm_processor, mm_source, mm_schemes = self._media.labels()
        if self._config.language_model_only:  # it could not expand media references (servicer.py GetServerInfo)
            mm_processor, mm_source, mm_schemes = "", "", ""
        kv_role = _KV_ROLE.get(self._config.role, "")
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=active,
            is_paused=False,
            last_receive_timestamp=self._core.last_receive,
            uptime_seconds=time.monotonic() - self._core.started,
            server_type=SERVER_TYPE,
            kv_connector=TRANSFER_BACKEND if kv_role else "",
            kv_role=kv_role,
            kv_engine_id=self._engine_id if kv_role else "",
            data_parallel_size=1,
            shm_namespace_id=shm_namespace_id(),
            kv_cache_dtype="auto" if kv_role else "",
            model_dtype="torch.float32",
            mm_processor=mm_processor,
            mm_processor_source=mm_source,
            mm_media_ref_schemes=mm_schemes,
            mm_device_do_normalize=self._core.normalizer is not None,
            mm_item_limits="",
            multimodal_encoder_dtype=self._config.encoder_dtype,
            max_num_seqs=self._config.model_workers,
        )

    def GetLoads(
        self, request: vllm_engine_pb2.GetLoadsRequest, context: grpc.ServicerContext
    ) -> vllm_engine_pb2.GetLoadsResponse:
        active, running = self._core.counts()
        load = vllm_engine_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=running,
            num_waiting_reqs=max(active - running, 0),
            num_total_reqs=active,
            max_running_requests=self._config.model_workers,
        )
        return vllm_engine_pb2.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version="mmgate-refengine", dp_rank_count=1, loads=[load]
        )
