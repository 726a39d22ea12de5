"""Which engine a worker runs, and what it says about itself: detection and typed capabilities.

Stage: select worker (worker registration and health).  In: a worker's gRPC answers; out: its
:class:`~mmgate.engines.base.Wire` and :class:`~mmgate.engines.base.Capabilities`.

Detection needs no flag, as the Rust gateway (SMG) does it: ``detect_grpc_backend``
(``model_gateway/src/workflow/steps/local/detect_backend.rs``) calls each runtime's own
``HealthCheck`` RPC in turn (sglang, vllm, trtllm, tokenspeed, mlx) and takes the first that
answers (``GrpcClient::connect(url, runtime)`` + ``health_check()``,
``model_gateway/src/routers/grpc/client.rs``).  A server serves exactly one engine service, so the
order only decides how many calls detection costs; every other service's method is answered
``UNIMPLEMENTED``.  The servicers also register ``grpc.health.v1.Health`` for Kubernetes probes,
with the engine's service name as the readiness service (``smg_grpc_servicer/<engine>/
health_servicer.py``: ``VllmHealthServicer.VLLM_SERVICE``, ``SGLangHealthServicer.SGLANG_SERVICE``,
``TokenSpeedHealthServicer.TOKENSPEED_SERVICE``, on the shared ``health_frame.HealthFrame``); the
engine services' own ``HealthCheck`` is what SMG calls, needs no extra package, and is answered by
a TokenSpeed encode worker too (it mounts a discovery-only ``TokenSpeedScheduler`` for exactly this,
``tokenspeed/server.py``), so that is the probe here.  A probe failure other than
``UNIMPLEMENTED`` ends detection (nothing listening, or no answer in time, is the same for every
service).

Capabilities, per wire (``GetModelInfo`` + ``GetServerInfo``, smg-grpc-proto 0.4):

* vllm: ``supports_vision`` (false under ``--language-model-only``: the servicer's
  ``model_info.supports_vision`` is vLLM's ``engine_accepts_mm_inputs``), ``shm_namespace_id``,
  ``multimodal_encoder_dtype``, ``mm_device_do_normalize``, ``mm_processor`` and
  ``mm_media_ref_schemes``; role from ``kv_role`` (``kv_producer`` prefill, ``kv_consumer``
  decode, else single).
* sglang: ``supports_vision``; ``server_args`` (a Struct of SGLang's ``ServerArgs``):
  ``disaggregation_mode`` (prefill | decode), ``encoder_only`` (encode), ``language_only``
  (a language-model-only worker); no shared memory (its ``TensorData`` has no ``shm``), no
  encoder dtype, no media references.
* tokenspeed: ``supported_modalities`` (else ``supports_vision``), ``multimodal_encoder_dtype``
  (GetModelInfo); ``server_args.disaggregation_mode`` (prefill | decode | encode);
  ``scheduler_info.shm_namespace_id``.

Every answer is also flattened to string labels (``GET /workers``), under the names the
transport policy reads (``shm_namespace_id``, ``multimodal_encoder_dtype``, ``mm_device_do_normalize``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from smg_grpc_proto.generated import (
    common_pb2,
    sglang_scheduler_pb2,
    tokenspeed_scheduler_pb2,
    vllm_engine_pb2,
)

from mmgate.engines.base import Capabilities, Role, Wire
from mmgate.engines.capabilities import VISION, worker_modalities
from mmgate.types import Modality

_PROTO_MODALITY = {common_pb2.IMAGE: Modality.IMAGE, common_pb2.VIDEO: Modality.VIDEO,
                   common_pb2.AUDIO: Modality.AUDIO}
#: ``disaggregation_mode`` of SGLang / TokenSpeed ``ServerArgs`` ("null" = not disaggregated)
_MODE_ROLE = {"prefill": Role.PREFILL, "decode": Role.DECODE, "encode": Role.ENCODE}
#: vLLM ``kv_transfer_config.kv_role`` (``kv_both``, or none: the worker runs whole requests)
_KV_ROLE = {"kv_producer": Role.PREFILL, "kv_consumer": Role.DECODE}


@dataclass(frozen=True, slots=True)
class WireService:
    """One wire's gRPC service: its name, its generated messages, how its info becomes capabilities."""

    wire: Wire
    service: str  # the full gRPC service name
    pb2: ModuleType  # the generated module: HealthCheckRequest, GetModelInfoRequest, GetServerInfoRequest, ...
    read: Callable[[Any, Any], Capabilities]  # (GetModelInfoResponse, GetServerInfoResponse) -> capabilities

    def method(self, name: str) -> str:
        """The full method path of RPC ``name`` (``/vllm.grpc.engine.VllmEngine/Generate``)."""
        return f"/{self.service}/{name}"

    def request(self, rpc: str) -> Any:
        """An empty ``<rpc>Request`` of this wire (HealthCheck, GetModelInfo, GetServerInfo)."""
        return getattr(self.pb2, f"{rpc}Request")()

    def response_type(self, rpc: str) -> Any:
        return getattr(self.pb2, f"{rpc}Response")


def _bool(value: object) -> str:
    return str(bool(value)).lower()


def _read_vllm(model: vllm_engine_pb2.GetModelInfoResponse, server: vllm_engine_pb2.GetServerInfoResponse,
               ) -> Capabilities:
    labels = {
        "model_path": model.model_path, "served_model_name": model.served_model_name,
        "model_type": model.model_type, "supports_vision": _bool(model.supports_vision),
        "server_type": server.server_type, "shm_namespace_id": server.shm_namespace_id,
        "mm_processor": server.mm_processor, "mm_media_ref_schemes": server.mm_media_ref_schemes,
        "mm_processor_source": server.mm_processor_source,
        "mm_device_do_normalize": _bool(server.mm_device_do_normalize),
        "mm_item_limits": server.mm_item_limits, "multimodal_encoder_dtype": server.multimodal_encoder_dtype,
        "max_num_seqs": str(server.max_num_seqs), "mm_encoder_budget": str(server.mm_encoder_budget),
        "kv_role": server.kv_role,
    }
    return Capabilities(
        wire=Wire.VLLM, role=_KV_ROLE.get(server.kv_role, Role.SINGLE), model_type=model.model_type,
        supports_vision=model.supports_vision, language_model_only=not model.supports_vision,
        modalities=worker_modalities(Wire.VLLM, VISION if model.supports_vision else ()),
        shm_namespace=server.shm_namespace_id, encoder_dtype=server.multimodal_encoder_dtype,
        device_normalize=server.mm_device_do_normalize, mm_processor=server.mm_processor,
        media_ref_schemes=frozenset(s.strip().lower() for s in server.mm_media_ref_schemes.split(",") if s.strip()),
        max_context_length=model.max_context_length, eos_token_ids=tuple(int(t) for t in model.eos_token_ids),
        labels=labels)


def _struct(msg: Any, name: str) -> dict[str, Any]:
    return MessageToDict(getattr(msg, name)) if msg.HasField(name) else {}


def _common_labels(model: Any, mode: str, args: dict[str, Any] | None = None) -> dict[str, str]:
    labels = {"model_path": model.model_path, "served_model_name": model.served_model_name,
              "model_type": model.model_type, "supports_vision": _bool(model.supports_vision),
              "disaggregation_mode": mode}
    port = (args or {}).get("disaggregation_bootstrap_port")
    if port:  # where a prefill (or encode) engine's handoff listens (routing/disagg.py)
        labels["disaggregation_bootstrap_port"] = str(int(port))
    return labels


def _read_sglang(model: sglang_scheduler_pb2.GetModelInfoResponse,
                 server: sglang_scheduler_pb2.GetServerInfoResponse) -> Capabilities:
    args = _struct(server, "server_args")
    mode = str(args.get("disaggregation_mode") or "null")
    role = Role.ENCODE if args.get("encoder_only") else _MODE_ROLE.get(mode, Role.SINGLE)
    language_only = bool(args.get("language_only"))
    labels = {**_common_labels(model, mode, args), "server_type": server.server_type, "sglang_version": server.sglang_version,
              "language_only": _bool(language_only)}
    return Capabilities(
        wire=Wire.SGLANG, role=role, model_type=model.model_type, supports_vision=model.supports_vision,
        language_model_only=language_only or not model.supports_vision,
        modalities=worker_modalities(Wire.SGLANG, VISION if model.supports_vision else ()),
        max_context_length=model.max_context_length, eos_token_ids=tuple(int(t) for t in model.eos_token_ids),
        labels=labels)


def _read_tokenspeed(model: tokenspeed_scheduler_pb2.GetModelInfoResponse,
                     server: tokenspeed_scheduler_pb2.GetServerInfoResponse) -> Capabilities:
    args, scheduler = _struct(server, "server_args"), _struct(server, "scheduler_info")
    mode = str(args.get("disaggregation_mode") or "null")
    reported = frozenset(_PROTO_MODALITY[m] for m in model.supported_modalities if m in _PROTO_MODALITY)
    # A servicer predating supported_modalities says only supports_vision.
    model_modalities = reported or (VISION if model.supports_vision else frozenset())
    shm_namespace = str(scheduler.get("shm_namespace_id") or "")
    labels = {**_common_labels(model, mode, args), "tokenspeed_version": server.tokenspeed_version,
              "supported_modalities": ",".join(sorted(m.value for m in model_modalities)),
              "shm_namespace_id": shm_namespace, "multimodal_encoder_dtype": model.multimodal_encoder_dtype}
    return Capabilities(
        wire=Wire.TOKENSPEED, role=_MODE_ROLE.get(mode, Role.SINGLE), model_type=model.model_type,
        supports_vision=model.supports_vision, language_model_only=not model_modalities,
        modalities=worker_modalities(Wire.TOKENSPEED, model_modalities), shm_namespace=shm_namespace,
        encoder_dtype=model.multimodal_encoder_dtype, max_context_length=model.max_context_length,
        eos_token_ids=tuple(int(t) for t in model.eos_token_ids), labels=labels)


SERVICES: Mapping[Wire, WireService] = {
    Wire.VLLM: WireService(Wire.VLLM, "vllm.grpc.engine.VllmEngine", vllm_engine_pb2, _read_vllm),
    Wire.SGLANG: WireService(Wire.SGLANG, "sglang.grpc.scheduler.SglangScheduler", sglang_scheduler_pb2,
                             _read_sglang),
    Wire.TOKENSPEED: WireService(Wire.TOKENSPEED, "tokenspeed.grpc.scheduler.TokenSpeedScheduler",
                                 tokenspeed_scheduler_pb2, _read_tokenspeed),
}
#: SMG's detection order (``detect_grpc_backend``), the wires mmgate knows
DETECTION_ORDER: tuple[Wire, ...] = (Wire.SGLANG, Wire.VLLM, Wire.TOKENSPEED)


def healthy_sync(channel: grpc.Channel, timeout_s: float = 1.0) -> bool:
    """Whether the worker behind a blocking ``channel`` says healthy, whatever engine it runs (the first
    engine service whose ``HealthCheck`` answers, as detection does).  Any other failure: False."""
    for wire in DETECTION_ORDER:
        svc = SERVICES[wire]
        call = channel.unary_unary(svc.method("HealthCheck"), request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=svc.response_type("HealthCheck").FromString)
        try:
            return bool(call(svc.request("HealthCheck"), timeout=timeout_s).healthy)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
                return False
    return False
