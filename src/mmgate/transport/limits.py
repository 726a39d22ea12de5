"""What one request's encoder tensors may weigh: the bound the transport and the budget put on them.

Stage: plan (used by the pipeline before decoding and before preprocessing).
In: the gateway's :class:`~mmgate.config.settings.TransportSettings` and planned tensor
sizes; out: the byte limit, the bytes per element the plan counts, and the 413
``multimodal_payload_too_large`` for a request over it (issue 15, item 5).

A request whose tensors cannot travel is the caller's request being too large:
refused with 413 (not retryable) from the plan, never sent to fail at the
engine with a retryable ``RESOURCE_EXHAUSTED``.

* inline: the tensors ride the gRPC ``GenerateRequest``, so the channel's
  message limit bounds them (:data:`GRPC_MAX_MESSAGE_BYTES`, the send/receive
  limit of ``mmgate.engines.client``);
* shm: tensors of at least ``shm_min_bytes`` ride shared memory; the message
  limit bounds them only when ``shm_min_bytes`` exceeds it;
* auto: as shm when this process has a shared-memory namespace (the worker's
  label is not known before worker selection; an inline fallback that then
  overflows is answered 413 by ``map_rpc_error``), else inline;
* ``--multimodal-max-inflight-bytes``, when set, bounds every transport
  (``mmgate.pipeline.budget`` refuses a request larger than the whole budget with 413 too,
  but only after preprocessing).
"""

from __future__ import annotations

from mmgate.errors import ErrorCode, GatewayError
from mmgate.config.settings import TensorTransport, TransportSettings
from mmgate.transport.shm import shm_namespace_id

#: gRPC message limit of the engine channels (send and receive), bytes
GRPC_MAX_MESSAGE_BYTES = 512 * 1024 * 1024


def encoder_bytes_limit(settings: TransportSettings) -> int | None:
    """The most encoder-tensor bytes one request may plan under ``settings`` (None: unbounded)."""
    mode = settings.tensor_transport
    if mode is TensorTransport.AUTO:
        mode = TensorTransport.SHM if shm_namespace_id() else TensorTransport.INLINE
    message: int | None = GRPC_MAX_MESSAGE_BYTES
    if mode is TensorTransport.SHM and settings.shm_min_bytes <= GRPC_MAX_MESSAGE_BYTES:
        message = None
    limits = [v for v in (message, settings.max_inflight_bytes) if v is not None]
    return min(limits) if limits else None


def element_bytes(settings: TransportSettings, raw: bool) -> int:
    """Bytes per pixel value the plan counts: 1 for raw uint8 pixels (a device-normalizing worker),
    else the wire encoder dtype's size: 2 for an explicit ``bfloat16``/``float16``, else 4 (float32;
    also under ``auto``, the dtype of a worker without a ``multimodal_encoder_dtype`` label)."""
    if raw:
        return 1
    return 2 if settings.encoder_dtype in ("bfloat16", "float16") else 4


def payload_too_large(planned: int, limit: int, param: str | None) -> GatewayError:
    """The 413 of a request whose planned encoder tensors (``planned`` bytes) exceed ``limit``."""
    return GatewayError(ErrorCode.MULTIMODAL_PAYLOAD_TOO_LARGE,
                        f"the request's media expand to {planned} bytes of encoder input, more than the "
                        f"{limit} bytes the transport to the engine carries", param)
