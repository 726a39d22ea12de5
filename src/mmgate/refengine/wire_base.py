"""What every wire's servicer shares: the Generate flow, refusals, and the labels all wires report.

Stage: engine (gRPC handlers).  In: a wire's request, a reader that turns it into a
:class:`~mmgate.refengine.core.Leg` and a writer factory (:mod:`.streaming`); out: the wire's
response stream, or the RPC ended with a status.

Errors: a refused request ends the RPC with ``INVALID_ARGUMENT`` and the reason as details (the
engine's own checks, the model code's ``ValueError`` / ``TypeError`` / ``IndexError`` /
``RuntimeError`` on the request's inputs, unchanged); a handoff that did not happen
(:mod:`.handoff`: nothing listening, an unknown room, a prefill or encoder that never published)
``UNAVAILABLE`` (the gateway's retryable 503); a stream slot, request id or room already taken
``RESOURCE_EXHAUSTED`` / ``ALREADY_EXISTS``; anything else ``INTERNAL``, logged with its
traceback, the server keeps serving (:func:`mmgate.refengine.core.grpc_status`).
"""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from mmgate.refengine.core import EngineCore, EngineShutdown, Leg, Run, grpc_status
from mmgate.refengine.streaming import Writer, drive

logger = logging.getLogger("mmgate.refengine")

#: the version label the non-vLLM wires report (``sglang_version`` / ``tokenspeed_version``)
ENGINE_VERSION = "mmgate-refengine"
#: ``disaggregation_transfer_backend`` / ``kv_connector`` of a disaggregated reference engine: its own handoff
TRANSFER_BACKEND = "mmgate-refengine-handoff"


def refuse(request_id: str, exc: BaseException, context: grpc.ServicerContext) -> None:
    """End the RPC with ``exc``'s status (never returns)."""
    code, details = grpc_status(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("request %s failed", request_id, exc_info=exc)
    else:
        logger.info("request %s refused: %s", request_id, details)
    context.abort(code, details)


def serve_generate(core: EngineCore, request_id: str, context: grpc.ServicerContext, read: Callable[[], Leg],
                   writer_for: Callable[[Run], Writer]) -> Iterator[Any]:
    """One Generate stream: a slot, a registered id, the leg read and started, its messages.

    Once the engine is shutting down (:meth:`EngineCore.shutdown` cancels every running leg) the stream
    ends with ``UNAVAILABLE``, as a dying engine's connection does, not with the ``abort`` Complete its
    cancelled generation produces: that one answers the wire's ``Abort`` only."""
    if not core.try_stream():
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "engine busy: every Generate stream slot is taken")
    try:
        request_id = request_id or uuid.uuid4().hex
        cancelled = core.register(request_id)
        if cancelled is None:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already running")
        assert cancelled is not None
        context.add_callback(cancelled.set)  # client gone or deadline passed
        try:
            run = _start(core, request_id, cancelled, read, context)
            messages = drive(run, writer_for(run), lambda: core.finish(request_id, cancelled))
            while True:
                try:
                    message = next(messages)
                except StopIteration:
                    break
                except EngineShutdown:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "engine is shutting down")
                except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                    refuse(request_id, exc, context)
                if core.shutting_down:  # a stopping engine's streams break off, never end in an ``abort`` Complete
                    context.abort(grpc.StatusCode.UNAVAILABLE, "engine is shutting down")
                yield message
        finally:
            core.finish(request_id, cancelled)
    finally:
        core.release_stream()


def _start(core: EngineCore, request_id: str, cancelled: Any, read: Callable[[], Leg],
           context: grpc.ServicerContext) -> Run:
    try:
        return core.start(read(), cancelled)
    except EngineShutdown:
        context.abort(grpc.StatusCode.UNAVAILABLE, "engine is shutting down")
    except Exception as exc:  # noqa: BLE001 - every failure becomes a status
        refuse(request_id, exc, context)
    raise AssertionError("unreachable")  # context.abort raised


def advertised_host(host: str) -> str:
    """The address a peer reaches this engine's handoff listener at: ``host``, or for a wildcard
    bind this machine's name."""
    if host in ("", "0.0.0.0", "::"):
        import socket

        return socket.gethostname()
    return host


def scheduler_loads(pb: Any, core: EngineCore, max_running: int) -> Any:
    """The SGLang / TokenSpeed ``GetLoadsResponse`` (their protos share its shape; ``pb`` is the wire's
    ``*_scheduler_pb2`` module): one DP rank's core load, requests running on a model thread, waiting for one,
    in all (``smg-grpc-servicer`` 0.14.1 ``sglang/servicer.py`` / ``tokenspeed/servicer.py`` ``GetLoads``)."""
    active, running = core.counts()
    load = pb.SchedulerLoad(dp_rank=0, num_running_reqs=running, num_waiting_reqs=max(active - running, 0),
                            num_total_reqs=active, max_running_requests=max_running)
    return pb.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(), version="mmgate-refengine",
                               dp_rank_count=1, loads=[load])
