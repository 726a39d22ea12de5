"""The one async client of a worker, whatever engine it runs.

Stage: transport.  A worker is a ``host:port``; the client finds which engine service it serves
(:mod:`mmgate.engines.probe`: each wire's ``HealthCheck`` in SMG's order, no flag), probes its
health and capabilities (``GetModelInfo`` + ``GetServerInfo`` -> :class:`Capabilities`), and runs
calls: an :class:`EncodedRequest` of the worker's wire in, :class:`EngineEvent` values out, RPC
failures raised as :class:`~mmgate.errors.GatewayError` (the wire adapter's ``map_error``).

Health probes (:meth:`WorkerClient.probe`) classify a failure instead of folding it into
``False``: nothing listening (``UNAVAILABLE``) is told apart from a probe that ran out of time
(``DEADLINE_EXCEEDED``, a busy worker looks like that) so that :mod:`mmgate.routing.workers` can
tell busy from dead.  ``last_answer`` is when any call of this client last got a message back
(a Generate stream answering is proof of life too).  A worker whose known service starts
answering ``UNIMPLEMENTED`` (another engine now listens there) is detected again.

Liveness: calls carry no deadline (a generation may run for minutes); a peer that goes silent without
closing (a frozen engine process, a network partition) is found by HTTP/2 keepalive pings on the channel
(:func:`channel_options`, SMG's engine channel profile), which close the connection and fail every call on
it with ``UNAVAILABLE`` -> 503 ``engine_unavailable`` (an ``error`` event in a started stream) within about
``interval_s + timeout_s`` of the last byte the engine sent.  Health probes cannot do this: a probe timing
out while a request is in flight counts as "busy" (:mod:`mmgate.routing.workers`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc._cython import cygrpc
from smg_grpc_proto.generated import common_pb2

from mmgate.engines.adapter import WireAdapter, adapter_for
from mmgate.engines.base import (
    Capabilities,
    EncodedRequest,
    EngineEvent,
    Probe,
    ProbeOutcome,
    Role,
    Wire,
)
from mmgate.engines.loads import KvBatch, WorkerLoad, batch_from_proto, load_from_response
from mmgate.engines.probe import DETECTION_ORDER, SERVICES, WireService
from mmgate.engines.rpc_errors import map_rpc_error
from mmgate.errors import ErrorCode, GatewayError
from mmgate.config.settings import KeepaliveSettings
from mmgate.transport.limits import GRPC_MAX_MESSAGE_BYTES
from mmgate.transport.placement import release_pages

log = logging.getLogger("mmgate.engines")

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
    # A restarted worker is reconnected within a few seconds (gRPC's default backoff grows to 120 s).
    ("grpc.max_reconnect_backoff_ms", 5000),
]


#: SMG's engine channel keepalive (ping after 30 s of silence, 10 s for the ack): ``--engine-keepalive-*``
DEFAULT_KEEPALIVE = KeepaliveSettings()


def channel_options(keepalive: KeepaliveSettings) -> list[tuple[str, int]]:
    """:data:`CHANNEL_OPTIONS` plus HTTP/2 keepalive, as SMG's engine channels (lightseekorg/smg
    ``crates/grpc_client/src/channel.rs`` ``connect_channel``: tonic ``http2_keep_alive_interval``,
    ``keep_alive_timeout``, ``keep_alive_while_idle(true)``), in grpc core's channel arguments.

    * ``grpc.keepalive_time_ms``: ping once the connection received nothing for ``interval_s`` (grpc core
      restarts the timer on every read, so a connection carrying answers or health probes is never pinged;
      core clamps it only to 1 ms -- grpc-go and grpc-java raise a client's to 10 s, tonic not at all);
    * ``grpc.keepalive_timeout_ms`` and ``grpc.http2.ping_timeout_ms``: how long an ack may take.  grpc core
      1.85 times a keepalive ping out with the second (its default is 60 s), not the first: both are set;
    * ``grpc.keepalive_permit_without_calls``: ping an idle connection too (``keep_alive_while_idle``);
    * ``grpc.http2.max_pings_without_data`` 0: keep pinging while the gateway sends nothing.  The default (2)
      stops the pings of a connection whose only call waits on a silent stream, which is the hang this is for.

    The engine must accept pings this frequent (docs/engines.md, "Liveness").
    """
    timeout_ms = round(keepalive.timeout_s * 1000)
    return [
        *CHANNEL_OPTIONS,
        ("grpc.keepalive_time_ms", round(keepalive.interval_s * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def probe_outcome(code: grpc.StatusCode) -> ProbeOutcome:
    """The outcome a failed probe RPC with status ``code`` counts as."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return ProbeOutcome.UNREACHABLE
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ProbeOutcome.TIMEOUT
    return ProbeOutcome.ERROR


def _engine_abort(target: str) -> GatewayError:
    return GatewayError(ErrorCode.ENGINE_UNAVAILABLE, f"worker {target} aborted the request before finishing it")


@dataclass(frozen=True, slots=True)
class BundleChunk:
    """One piece of a worker's bundle archive (a ``GetTokenizerChunk``, smg-grpc-proto ``common.proto``)."""

    data: bytes  # the archive's next bytes (the chunks concatenated are the ZIP)
    sha256: str  # the whole archive's SHA-256 hex digest on the last chunk; "" on every other


class _NotThisService(Exception):
    """The worker answered UNIMPLEMENTED: it serves another engine service."""


#: grpcio versions whose aio send path was read and is shown (tests/engines/test_client_memory.py) to copy the
#: serialized request before its send task first waits: a release after that copy is safe only there
RELEASE_VERIFIED_GRPC = ((1, 60), (1, 85))


def _grpc_copies_before_sending(version: str = grpc.__version__) -> bool:
    """Whether this grpcio copies the request into its own slice before the send task first waits.

    True only for the versions of :data:`RELEASE_VERIFIED_GRPC` without grpc's ``python_zero_copy``
    experiment switched on (upstream grpc after 1.85 adds it: ``SendMessageOperation.c`` then
    references the caller's bytes instead of copying them, and releasing them would send zeros).
    """
    try:
        major_minor = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    low, high = RELEASE_VERIFIED_GRPC
    zero_copy = getattr(cygrpc, "python_zero_copy_enabled", None)
    return low <= major_minor <= high and not (zero_copy is not None and zero_copy())


_RELEASE_SAFE = _grpc_copies_before_sending()


@functools.cache
def _warn_release_off() -> None:
    log.warning("grpcio %s is not one whose send path copies the request first (verified: %s.%s to %s.%s): "
                "--multimodal-release-sent-min-bytes is off", grpc.__version__, *RELEASE_VERIFIED_GRPC[0],
                *RELEASE_VERIFIED_GRPC[1])


class _ReleaseAfterCopy:
    """A serialized request whose pages are given back once grpc-python has copied it for sending.

    grpc-python (1.60-1.85, ``grpc/aio/_call.py`` ``UnaryStreamCall._send_unary_request``) calls the
    request serializer, then, in the same step of its send task and before that task first waits,
    copies the bytes into its own slice (``_cygrpc/aio/callback_common.pyx.pxi`` ``execute_batch``:
    ``_BatchOperationTag.prepare`` -> ``SendMessageOperation.c`` -> ``grpc_slice_from_copied_buffer``)
    and starts the batch.  A callback scheduled from the serializer (``call_soon``) therefore runs
    after the copy; it releases the caller's pages (:func:`~mmgate.transport.placement.release_pages`),
    so a large request is held once, not twice, while it travels.  Shown on real gRPC by
    ``tests/engines/test_client_memory.py`` (the worker receives every byte; the caller's copy reads
    zeros afterwards).
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    @staticmethod
    def serialize(request: _ReleaseAfterCopy) -> bytes:
        asyncio.get_running_loop().call_soon(release_pages, request.data)
        return request.data


class WorkerClient:
    """An async client for one worker at ``host:port`` (created on the serving event loop); its channel pings
    the worker as ``keepalive`` says (:func:`channel_options`)."""

    def __init__(self, target: str, keepalive: KeepaliveSettings = DEFAULT_KEEPALIVE,
                 release_sent_min_bytes: int = 0) -> None:
        self.target = target
        self.wire: Wire | None = None  # detected by the first probe that reaches the worker
        self.last_answer = 0.0  # time.monotonic() of the last message any RPC got back; 0.0: none yet
        #: a Generate request at least this large gives its pages back once grpc has copied it (0: never)
        self.release_sent_min_bytes = release_sent_min_bytes if release_sent_min_bytes and _RELEASE_SAFE else 0
        if release_sent_min_bytes and not _RELEASE_SAFE:
            _warn_release_off()
        self._channel = grpc.aio.insecure_channel(target, options=channel_options(keepalive))
        self._methods: dict[tuple[str, bool], Any] = {}
        self._releasing: dict[str, Any] = {}  # method -> its streaming callable with the releasing serializer
        self._warned = False

    @property
    def adapter(self) -> WireAdapter | None:
        """The adapter of the detected wire (None: not detected yet, or no adapter for it)."""
        return adapter_for(self.wire)

    async def close(self) -> None:
        await self._channel.close()

    def _unary(self, svc: WireService, rpc: str) -> Any:
        key = (svc.method(rpc), False)
        if key not in self._methods:
            self._methods[key] = self._channel.unary_unary(
                key[0], request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=svc.response_type(rpc).FromString)
        return self._methods[key]

    async def _call(self, svc: WireService, rpc: str, timeout_s: float) -> Any:
        try:
            resp = await self._unary(svc, rpc)(svc.request(rpc), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise _NotThisService from None
            raise
        self.last_answer = time.monotonic()
        return resp

    async def _health(self, timeout_s: float) -> tuple[WireService, Any] | None:
        """(service, HealthCheckResponse) of the worker's engine service; detects it when unknown.

        None: the worker serves none of the engine services.  Raises ``AioRpcError`` for any
        other failure (that ends detection: every service would fail the same way).
        """
        if self.wire is not None:
            svc = SERVICES[self.wire]
            try:
                return svc, await self._call(svc, "HealthCheck", timeout_s)
            except _NotThisService:
                log.warning("worker %s no longer serves %s: detecting its engine again", self.target, svc.service)
                self.wire = None
        for wire in DETECTION_ORDER:
            svc = SERVICES[wire]
            try:
                health = await self._call(svc, "HealthCheck", timeout_s)
            except _NotThisService:
                continue
            self.wire = wire
            log.info("worker %s serves %s (wire %s)", self.target, svc.service, wire.value)
            if adapter_for(wire) is None and not self._warned:
                self._warned = True
                log.warning("worker %s speaks the %s wire, which this gateway has no adapter for: it is listed "
                            "and never selected", self.target, wire.value)
            return svc, health
        return None

    async def probe(self, timeout_s: float = 2.0) -> Probe:
        """HealthCheck of the worker's engine service (detected first when unknown), then GetModelInfo +
        GetServerInfo, each within ``timeout_s`` seconds.

        Never raises for an RPC failure: it is classified (see :class:`ProbeOutcome`).
        """
        try:
            found = await self._health(timeout_s)
        except grpc.aio.AioRpcError as exc:
            return Probe(probe_outcome(exc.code()))
        if found is None:
            return Probe(ProbeOutcome.ERROR)
        svc, health = found
        if not health.healthy:
            return Probe(ProbeOutcome.NOT_SERVING, wire=svc.wire)
        try:
            caps = await self._info(svc, timeout_s)
        except _NotThisService:
            return Probe(ProbeOutcome.ERROR, wire=svc.wire)
        except grpc.aio.AioRpcError as exc:
            return Probe(probe_outcome(exc.code()), wire=svc.wire)
        return Probe(ProbeOutcome.OK, caps, wire=svc.wire)

    async def loads(self, timeout_s: float = 2.0) -> WorkerLoad | None:
        """The worker's ``GetLoads`` answer (its wire's, summed over DP ranks); None when its wire is not
        detected yet or it does not answer (UNIMPLEMENTED, an RPC failure, ``timeout_s`` seconds passed)."""
        if self.wire is None:
            return None
        try:
            return load_from_response(await self._call(SERVICES[self.wire], "GetLoads", timeout_s))
        except (_NotThisService, grpc.aio.AioRpcError):
            return None

    async def kv_events(self, start_sequence: int = 0) -> AsyncGenerator[KvBatch, None]:
        """The worker's ``SubscribeKvEvents`` stream (``common.proto`` ``KvEventBatch``), from
        ``start_sequence`` (0: its current state).  Ends when the stream ends.

        Raises:
            grpc.aio.AioRpcError: the subscription failed (UNIMPLEMENTED: the worker publishes no KV events).
        """
        if self.wire is None:
            return
        from smg_grpc_proto.generated import common_pb2

        key = (SERVICES[self.wire].method("SubscribeKvEvents"), True)
        if key not in self._methods:
            self._methods[key] = self._channel.unary_stream(
                key[0], request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=common_pb2.KvEventBatch.FromString)
        call = self._methods[key](common_pb2.SubscribeKvEventsRequest(start_sequence_number=start_sequence))
        try:
            while (batch := await call.read()) is not grpc.aio.EOF:
                self.last_answer = time.monotonic()
                yield batch_from_proto(batch)
        finally:
            if not call.done():
                call.cancel()

    async def _info(self, svc: WireService, timeout_s: float) -> Capabilities:
        model = await self._call(svc, "GetModelInfo", timeout_s)
        server = await self._call(svc, "GetServerInfo", timeout_s)
        return svc.read(model, server)

    def _stream(self, adapter: WireAdapter, role: Role, release: bool = False) -> Any:
        method, parse = adapter.rpc(role)
        if release:
            if method not in self._releasing:
                self._releasing[method] = self._channel.unary_stream(
                    method, request_serializer=_ReleaseAfterCopy.serialize, response_deserializer=parse)
            return self._releasing[method]
        key = (method, True)
        if key not in self._methods:
            self._methods[key] = self._channel.unary_stream(method, request_serializer=None,
                                                            response_deserializer=parse)
        return self._methods[key]

    async def unary(self, method: str, parse: Any, request: EncodedRequest, timeout_s: float | None = None) -> Any:
        """One unary call of this worker's wire (e.g. TokenSpeed's ``Encode``), its response parsed.

        Raises:
            GatewayError: the call's failure, mapped by the wire's adapter.
        """
        adapter = self.adapter
        if adapter is None:
            raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, f"no engine adapter for worker {self.target}")
        key = (method, False)
        if key not in self._methods:
            self._methods[key] = self._channel.unary_unary(method, request_serializer=None,
                                                           response_deserializer=parse)
        try:
            response = await self._methods[key](request.data, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise adapter.map_error(exc) from None
        self.last_answer = time.monotonic()
        return response

    async def generate(self, request: EncodedRequest, role: Role = Role.SINGLE,
                       timeout_s: float | None = None) -> AsyncGenerator[EngineEvent, None]:
        """Run one leg (``request``, encoded by this worker's adapter) and stream its events; cancels the
        call if the consumer stops early.

        A ``complete`` event with ``finish_reason`` ``abort`` ends the leg with a retryable
        ``engine_unavailable``: the gateway never sends ``Abort`` (it cancels the call, and then reads
        nothing more), so an aborted choice is the engine's own doing (shutting down, a failed KV transfer)
        and its output is cut short; answering it as a finished choice would hand the client a truncated
        completion as a whole one.  (vLLM's and SMG's HTTP servers pass ``abort`` on as a finish reason;
        SGLang's tokenizer and gRPC request managers raise on a scheduler's abort.)

        A request of at least ``release_sent_min_bytes`` (``--multimodal-release-sent-min-bytes``) gives its
        pages back once grpc has copied it for sending (:class:`_ReleaseAfterCopy`; only on the grpcio
        versions of :data:`RELEASE_VERIFIED_GRPC`): the whole pages inside its ``data`` then read as zeros,
        and the request cannot be sent again.

        Raises:
            GatewayError: the call's failure, mapped by the wire's adapter; ``engine_unavailable`` for an
                engine abort; ``internal_error`` for a request whose bytes were released by an earlier send.
        """
        adapter = self.adapter
        if adapter is None:
            raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, f"no engine adapter for worker {self.target}")
        if request.released:
            raise GatewayError(ErrorCode.INTERNAL_ERROR, "a request whose bytes were released after sending "
                                                         "cannot be sent again")
        if self.release_sent_min_bytes and len(request.data) >= self.release_sent_min_bytes:
            call = self._stream(adapter, role, release=True)(_ReleaseAfterCopy(request.data), timeout=timeout_s)
            request.released.append(True)  # the send task releases the pages once grpc has copied them
        else:
            call = self._stream(adapter, role)(request.data, timeout=timeout_s)
        try:
            # ``read()``, not ``async for``: grpc.aio's iterator is an async generator that refers back to its call
            # (``_StreamResponseMixin.__aiter__``), a cycle that keeps the call, and the request bytes it holds,
            # alive until the next garbage collection: with inline tensors, tens of MB per request.
            while (resp := await call.read()) is not grpc.aio.EOF:
                self.last_answer = time.monotonic()
                for event in adapter.events(resp):
                    if event.is_complete and event.finish_reason == "abort":
                        raise _engine_abort(self.target)
                    yield event
        except grpc.aio.AioRpcError as exc:
            raise adapter.map_error(exc) from None
        finally:
            if not call.done():
                call.cancel()

    async def get_tokenizer(self, timeout_s: float, max_bytes: int) -> AsyncGenerator[BundleChunk, None]:
        """Stream the worker's ``GetTokenizer`` (every wire serves it with the common messages, under its own
        service: :data:`~mmgate.engines.probe.SERVICES`), detecting the wire first when unknown.

        Mirrors SMG's ``impl_get_tokenizer`` / ``collect_bundle_from_rpc`` (lightseekorg/smg
        ``crates/grpc_client/src/lib.rs``, ``tokenizer_bundle.rs``): one deadline of ``timeout_s`` seconds
        covers detection, the call and every chunk; a chunk that would bring the bytes read past
        ``max_bytes`` is not yielded and the call is cancelled (nothing more is read).  The consumer checks
        the archive (:mod:`mmgate.routing.bundles`).

        Raises:
            GatewayError: the call failed (:func:`~mmgate.engines.rpc_errors.map_rpc_error`: nothing
                listening or out of time ``engine_unavailable``; a servicer without the RPC, ``UNIMPLEMENTED``,
                ``engine_error``); ``no_healthy_worker`` for a worker serving no engine service;
                ``engine_error`` for an archive longer than ``max_bytes``.
        """
        deadline = time.monotonic() + timeout_s
        if self.wire is None:
            try:
                found = await self._health(timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise map_rpc_error(exc) from None
            if found is None:
                raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, f"worker {self.target} serves no engine service")
        assert self.wire is not None
        method = SERVICES[self.wire].method("GetTokenizer")
        key = (method, True)
        if key not in self._methods:
            self._methods[key] = self._channel.unary_stream(
                method, request_serializer=common_pb2.GetTokenizerRequest.SerializeToString,
                response_deserializer=common_pb2.GetTokenizerChunk.FromString)
        call = self._methods[key](common_pb2.GetTokenizerRequest(), timeout=max(deadline - time.monotonic(), 0.001))
        received = 0
        try:
            while (chunk := await call.read()) is not grpc.aio.EOF:
                self.last_answer = time.monotonic()
                received += len(chunk.data)
                if received > max_bytes:
                    raise GatewayError(ErrorCode.ENGINE_ERROR, f"the bundle archive exceeds {max_bytes} bytes")
                yield BundleChunk(chunk.data, chunk.sha256)
        except grpc.aio.AioRpcError as exc:
            raise map_rpc_error(exc) from None
        finally:
            if not call.done():
                call.cancel()
