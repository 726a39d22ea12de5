"""The standard ``grpc.health.v1.Health`` service, as the real servicers register it.

Stage: engine management.  In: ``Check`` / ``Watch`` with a service name; out: its serving status.

Mirrors smg-grpc-servicer 0.14.1 ``health_frame.py`` ``HealthFrame`` and the per-engine
``health_servicer.py`` files (``VllmHealthServicer.VLLM_SERVICE``,
``SGLangHealthServicer.SGLANG_SERVICE``, ``TokenSpeedHealthServicer.TOKENSPEED_SERVICE``; a
TokenSpeed encode worker registers the same TokenSpeed health servicer): two known services,
``""`` (the whole server, liveness) and the engine's own service name (readiness); a server that
is shutting down answers NOT_SERVING for both; an unknown service is refused with NOT_FOUND on
``Check`` and answered SERVICE_UNKNOWN on ``Watch`` (which yields the current status once).

``grpcio-health-checking`` is not a dependency of mmgate, so the two messages of
``grpc/health/v1/health.proto`` are built here from their descriptor (in a private descriptor
pool: a process that also imports ``grpc_health`` keeps its own).  The wire format is the
standard one: any health client reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE_NAME = "grpc.health.v1.Health"
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3


def _messages() -> tuple[Any, Any]:
    """(HealthCheckRequest, HealthCheckResponse) classes of ``grpc/health/v1/health.proto``."""
    f = descriptor_pb2.FileDescriptorProto(name="mmgate_refengine/grpc/health/v1/health.proto",
                                           package="grpc.health.v1", syntax="proto3")
    req = f.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    resp = f.message_type.add(name="HealthCheckResponse")
    status = resp.enum_type.add(name="ServingStatus")
    for name, number in (("UNKNOWN", UNKNOWN), ("SERVING", SERVING), ("NOT_SERVING", NOT_SERVING),
                         ("SERVICE_UNKNOWN", SERVICE_UNKNOWN)):
        status.value.add(name=name, number=number)
    resp.field.add(name="status", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_ENUM,
                   label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
                   type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")))


HealthCheckRequest, HealthCheckResponse = _messages()


class HealthService:
    """``grpc.health.v1.Health`` for one engine service name; ``shutting_down()`` flips both to NOT_SERVING."""

    def __init__(self, engine_service: str, shutting_down: Callable[[], bool]) -> None:
        self.engine_service = engine_service
        self._shutting_down = shutting_down

    def status_of(self, service: str) -> int | None:
        if service not in ("", self.engine_service):
            return None
        return NOT_SERVING if self._shutting_down() else SERVING

    def check(self, request: Any, context: grpc.ServicerContext) -> Any:
        status = self.status_of(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"Unknown service: {request.service}")
            return HealthCheckResponse(status=SERVICE_UNKNOWN)
        return HealthCheckResponse(status=status)

    def watch(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        status = self.status_of(request.service)
        yield HealthCheckResponse(status=SERVICE_UNKNOWN if status is None else status)

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's handler, for ``server.add_generic_rpc_handlers``."""
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Check": grpc.unary_unary_rpc_method_handler(
                self.check, request_deserializer=HealthCheckRequest.FromString,
                response_serializer=HealthCheckResponse.SerializeToString),
            "Watch": grpc.unary_stream_rpc_method_handler(
                self.watch, request_deserializer=HealthCheckRequest.FromString,
                response_serializer=HealthCheckResponse.SerializeToString),
        })
