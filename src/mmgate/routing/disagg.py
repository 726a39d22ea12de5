"""Prefill/decode disaggregation (``--pd-disaggregation``): pair selection and the two legs of one request.

Stage: select worker -> assemble -> transport -> engine, for a pair.  In: a validated chat request and the
gateway state; out: an :class:`~mmgate.routing.dispatch.EngineAnswer` whose stream is the decode leg's
(:class:`PdDispatcher`).

Per request (docs/disaggregation.md): the least-loaded healthy prefill worker and the least-loaded healthy
decode worker of the same wire are picked (:func:`select_pair`).  The media are processed once, for the
prefill leg; both legs are encoded by the wire's adapter (``Role.PREFILL`` with the tensors,
``Role.DECODE`` with the media's identity only: SGLang no media, TokenSpeed items without encoder input,
vLLM hashes, placeholders and grids; never through shared memory, so the decode leg never names a
segment the prefill's lease unlinks).  How the legs meet is the wire's (``WireAdapter.sequential_pd``):

* SGLang, TokenSpeed (:func:`_start_together`): a bootstrap room is minted (:func:`mint_room`); the
  bootstrap host is the prefill worker's host, the port its ``--prefill URL BOOTSTRAP_PORT`` or else the
  ``disaggregation_bootstrap_port`` it reports; both legs carry them and are sent together.  The answer
  streams from the decode leg; the prefill leg's reply (its first token, which the decode engine continues
  from) is drained and dropped, and its shared-memory lease released when it ends.
* vLLM (:func:`_start_sequential`), as the Rust gateway SMG runs it (``execute_sequential_pd``,
  ``model_gateway/src/routers/grpc/common/stages/request_execution.rs``): the prefill leg first (one token,
  tagged ``do_remote_decode``), read to its end; its shared-memory lease is released then (the engine has
  read the tensors); the ``kv_transfer_params`` of its Complete go to the decode leg, which is then sent.
  ``n > 1``: the KV handoff has one consumer, so (as SMG) no handoff is relayed; the decode worker computes
  the prompt itself, which a text-only request allows (mmgate sends no prefill leg then: nothing of it
  would be used); a request with media and ``n > 1`` is refused before anything is fetched (400
  ``invalid_request``, param ``n``): the decode leg never carries pixels.

Encode disaggregation (``--epd-disaggregation``; a wire whose adapter offers it,
:meth:`~mmgate.engines.adapter.WireAdapter.epd`: TokenSpeed): each media item (prompt order) goes to an
encode worker picked by ``--encode-policy`` (:func:`pick_encoder`; default rendezvous hashing on the item's
content hash) in its own ``Encode`` RPC with its own room; the prefill leg carries ``encode_bootstrap_info``
(per item: the encoder's host, bootstrap port, room) and items without encoder input; a text-only request
sends no Encode.  The prefill drain and the Encode calls run as one task group (:func:`_side`): the first
failure cancels the rest and the decode leg's wait, and an encode worker's failure is a retryable 503
``engine_unavailable``; the request's shared-memory lease is released when that group ends.

Refusals before anything is fetched, when a decode worker reports ``language_model_only``: M-RoPE models
with media (``pd_decode_language_model_only_mrope``), ``n > 1`` (``..._n_samples``); and media references
for worker-side processing are never forwarded in PD mode (``..._media_refs`` when such a decode worker
would have to take them).  With decode workers of both kinds, a request only a full decode worker can
serve is paired with one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import TYPE_CHECKING

from mmgate.observe import metrics, timing_log
from mmgate.engines.adapter import WireAdapter
from mmgate.engines.base import Bootstrap, EncodedRequest, EngineEvent, Role
from mmgate.engines.capabilities import MediaPositions, Positions
from mmgate.errors import ErrorCode, GatewayError
from mmgate.pipeline.routing_key import RoutingKey
from mmgate.routing.capability import check_capable, media_kinds, media_positions
from mmgate.routing.dispatch import Dispatcher, EngineAnswer, finish, router_tally
from mmgate.routing.mm_processing import Mode
from mmgate.routing.policies.base import RouteRequest
from mmgate.routing.workers import Worker, WorkerRegistry
from mmgate.transport.shm import ShmLease
from mmgate.types import Modality, PreparedRequest

if TYPE_CHECKING:
    from mmgate.request.protocol import ChatCompletionRequest
    from mmgate.routing.context import DispatchContext

log = logging.getLogger("mmgate.routing")

#: SGLang's ``DisaggregatedParams.bootstrap_room`` is an int32 (TokenSpeed's a 63-bit int): rooms fit both
ROOM_MAX = 2**31 - 1


def mint_room() -> int:
    """A random bootstrap room in 0..2**31-1 (SMG mints a random room per request; the SGLang wire's
    field is int32, so the range is the one both wires carry)."""
    return secrets.randbelow(ROOM_MAX + 1)


def bootstrap_port(worker: Worker) -> int:
    """The prefill worker's bootstrap port: ``--prefill URL BOOTSTRAP_PORT``, else its
    ``disaggregation_bootstrap_port`` label.

    Raises:
        GatewayError(NO_HEALTHY_WORKER): neither is known (retryable 503).
    """
    if worker.bootstrap_port:
        return worker.bootstrap_port
    reported = worker.labels.get("disaggregation_bootstrap_port", "")
    if reported.isdigit() and 0 < int(reported) < 65536:
        return int(reported)
    raise GatewayError(ErrorCode.NO_HEALTHY_WORKER,
                       f"{worker.role} worker {worker.url} has no bootstrap port (give --prefill URL BOOTSTRAP_PORT)")


def _uses_mrope(state: DispatchContext) -> bool:
    """Whether the served model positions media with M-RoPE, asked of its family (``Family.mrope``)."""
    return media_positions(state).positions is Positions.MROPE


def _n_samples_with_media() -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST,
                        "n > 1 with media cannot be served by a vLLM-wire prefill/decode pair: its KV handoff has "
                        "one consumer, so none is relayed for n > 1 and the decode worker would have to compute "
                        "the prompt itself, from pixels the decode leg never carries (docs/disaggregation.md)", "n")


def needs_full_decode(state: DispatchContext, req: ChatCompletionRequest) -> bool:
    """Whether ``req`` is one a language-model-only decode worker cannot serve (the refusals of
    :func:`check_pd_request`)."""
    has_media = bool(media_kinds(req))
    return req.n > 1 or (has_media and (_uses_mrope(state) or state.settings.mm_processing.value == Mode.WORKER.value))


def check_pd_request(state: DispatchContext, req: ChatCompletionRequest) -> None:
    """The refusals of PD mode that need nothing fetched: a language-model-only decode worker and a request it
    cannot serve; ``n > 1`` with media when every prefill worker is of a wire whose handoff serves one choice
    (vLLM).

    Raises:
        GatewayError: 400 ``pd_decode_language_model_only_mrope`` / ``..._media_refs`` / ``..._n_samples``,
            400 ``invalid_request`` (param ``n``).
    """
    _check_language_model_only(state, req)
    if req.n > 1 and media_kinds(req):
        adapters = [w.adapter for w in state.workers.workers if w.assigned_role is Role.PREFILL and w.adapter is not None]
        if adapters and not any(a.pd_n_samples for a in adapters):
            raise _n_samples_with_media()


def _check_language_model_only(state: DispatchContext, req: ChatCompletionRequest) -> None:
    decoders = [w for w in state.workers.workers if w.assigned_role is Role.DECODE and w.caps is not None]
    if not decoders or not all(w.caps is not None and w.caps.language_model_only for w in decoders):
        return
    has_media = bool(media_kinds(req))
    if req.n > 1:
        raise GatewayError(ErrorCode.PD_DECODE_LANGUAGE_MODEL_ONLY_N_SAMPLES,
                           "the decode workers run the language model only: n > 1 cannot be served disaggregated",
                           "n")
    if has_media and _uses_mrope(state):
        raise GatewayError(ErrorCode.PD_DECODE_LANGUAGE_MODEL_ONLY_MROPE,
                           "the decode workers run the language model only and this model positions media with "
                           "M-RoPE, which needs the media's grids on the decode leg", "messages")
    if has_media and state.settings.mm_processing.value == Mode.WORKER.value:
        raise GatewayError(ErrorCode.PD_DECODE_LANGUAGE_MODEL_ONLY_MEDIA_REFS,
                           "the decode workers run the language model only: media references for worker-side "
                           "processing cannot be served disaggregated", "messages")


def select_pair(registry: WorkerRegistry, modalities: frozenset[Modality],
                full_decode: bool = False, request: RouteRequest | None = None,
                positions: MediaPositions = MediaPositions()) -> tuple[Worker, Worker]:
    """The healthy prefill worker ``--prefill-policy`` picks and the healthy decode worker of the same PD wire
    ``--decode-policy`` picks, both for ``request`` (SMG ``routers/grpc/pd_router.rs``: one policy per leg);
    ``full_decode``: the request is one a language-model-only decode worker cannot serve, so one that is not
    is preferred (:func:`check_pd_request` refused it before when every decode worker is).  ``positions``: how
    the model positions media (:meth:`WorkerRegistry.select`).

    Raises:
        GatewayError(NO_HEALTHY_WORKER): no such pair (retryable 503), or MULTIMODAL_NOT_SUPPORTED.
    """
    prefill = registry.select(modalities, Role.PREFILL, request, positions)
    wire, adapter = prefill.wire, prefill.adapter
    if adapter is None or Role.PREFILL not in adapter.roles:  # a wire whose adapter encodes no PD legs
        raise GatewayError(ErrorCode.NO_HEALTHY_WORKER,
                           f"prefill/decode disaggregation over the {wire} wire is not implemented "
                           "(docs/disaggregation.md)")
    decoders = [w for w in registry.workers if w.assigned_role is Role.DECODE and w.healthy and w.wire == wire]
    if not decoders:
        raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, f"no healthy decode worker of the {wire} wire")
    if full_decode:
        decoders = [w for w in decoders if not (w.caps is not None and w.caps.language_model_only)]
        if not decoders:
            raise GatewayError(ErrorCode.NO_HEALTHY_WORKER,
                               f"no healthy decode worker of the {wire} wire runs the whole model (this request "
                               "cannot be served by a language-model-only one)")
    return prefill, registry.policies[Role.DECODE].select(decoders, request or RouteRequest())


async def _drain(responses: AsyncGenerator[EngineEvent, None]) -> None:
    """Read the prefill leg to its end (its first token is the decode leg's too: dropped here)."""
    try:
        async for _ in responses:
            pass
    finally:
        await responses.aclose()


class _EncodeFailed(Exception):
    """An encode worker's failure (a retryable 503 for the request)."""

    def __init__(self, worker: Worker, cause: BaseException) -> None:
        super().__init__(f"encode worker {worker.url} failed: {cause}")
        self.worker = worker


async def _encode_call(worker: Worker, request: EncodedRequest) -> None:
    """One item's ``Encode`` RPC, counted in the encode worker's ``in_flight`` while it runs (``GET /workers``,
    ``mmgate_active_requests``)."""
    epd = worker.adapter.epd() if worker.adapter is not None else None
    assert epd is not None and worker.client is not None
    method, parse = epd.encode_rpc()
    release = worker.hold()
    try:
        await worker.client.unary(method, parse, request)
    except GatewayError as exc:
        raise _EncodeFailed(worker, exc) from exc
    finally:
        release()


async def _side(prefill: AsyncGenerator[EngineEvent, None],
                encodes: list[tuple[Worker, Bootstrap, EncodedRequest]]) -> None:
    """The legs whose answers the client never sees, together: the prefill drained and each item's Encode RPC;
    the first failure cancels the others."""
    async with asyncio.TaskGroup() as group:
        group.create_task(_drain(prefill))
        for worker, _, request in encodes:
            group.create_task(_encode_call(worker, request))


def _side_error(exc: BaseException | None) -> BaseException:
    """The error the client gets for a failed prefill/encode side: an encode worker's failure is a retryable
    503; the prefill's own error as mapped."""
    leaves = list(exc.exceptions) if isinstance(exc, BaseExceptionGroup) else [exc]
    for leaf in leaves:
        if isinstance(leaf, _EncodeFailed):
            return GatewayError(ErrorCode.ENGINE_UNAVAILABLE, str(leaf))
    for leaf in leaves:
        if isinstance(leaf, GatewayError):
            return leaf
    return GatewayError(ErrorCode.ENGINE_UNAVAILABLE, f"prefill leg failed: {leaves[0]}")


_ROUND_ROBIN = itertools.count()


def pick_encoder(workers: list[Worker], content_hash: str, policy: str) -> Worker:
    """The encode worker of one item: ``consistent_hashing`` = rendezvous hashing on the item's content hash
    (the same media always meets the same encoder while the set of healthy encoders stands),
    ``round_robin`` or ``random``."""
    if policy == "round_robin":
        return workers[next(_ROUND_ROBIN) % len(workers)]
    if policy == "random":
        return workers[secrets.randbelow(len(workers))]
    return max(workers, key=lambda w: hashlib.blake2b(f"{w.url}|{content_hash}".encode(), digest_size=8).digest())


def _encode_legs(state: DispatchContext, adapter: WireAdapter, message: PreparedRequest,
                 lease: ShmLease) -> list[tuple[Worker, Bootstrap, EncodedRequest]]:
    """One Encode RPC per item (prompt order), each with its encode worker's bootstrap and its own room;
    none for a text-only request.

    Raises:
        GatewayError(NO_HEALTHY_WORKER): the prefill's wire has no encode disaggregation
            (:meth:`~mmgate.engines.adapter.WireAdapter.epd`), or items but no healthy encode worker of it.
    """
    epd = adapter.epd()
    if epd is None:
        raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, "encode disaggregation runs on the tokenspeed wire only")
    hashes = epd.item_hashes(message)
    if not hashes:
        return []
    encoders = [w for w in state.workers.workers
                if w.assigned_role is Role.ENCODE and w.healthy and w.wire == adapter.wire.value]
    if not encoders:
        raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, "no healthy encode worker")
    legs = []
    for index, content_hash in enumerate(hashes):
        worker = pick_encoder(encoders, content_hash, state.settings.encode_policy)
        boot = Bootstrap(worker.target.rpartition(":")[0], bootstrap_port(worker), mint_room())
        plan = adapter.plan(state.settings.transport, worker.labels)
        legs.append((worker, boot, epd.encode_item(message, index, boot, plan, lease)))
    return legs


class PdDispatcher(Dispatcher):
    """A prefill/decode pair per request, with encode workers under ``--epd-disaggregation`` (see the
    module docstring)."""

    async def start(self, state: DispatchContext, req: ChatCompletionRequest, request_id: str,
                    record: timing_log.RequestTiming | None) -> EngineAnswer:
        return await start_pd(state, req, request_id, record)


async def start_pd(state: DispatchContext, req: ChatCompletionRequest, request_id: str,
                   record: timing_log.RequestTiming | None) -> EngineAnswer:
    """Run ``req`` disaggregated up to the decode leg's first response (see the module docstring).

    Raises:
        GatewayError: a refusal, a selection failure, or either leg's failure (the prefill's when it failed
            first; a leg that is down gives a retryable 503).
    """
    check_pd_request(state, req)
    check_capable(state, req)
    pair: list[tuple[Worker, Worker]] = []
    full_decode = needs_full_decode(state, req)

    def choose_worker(modalities: frozenset[Modality], key: RoutingKey) -> bool:
        prefill, decode = select_pair(state.workers, modalities, full_decode, RouteRequest.current(key, req.user),
                                      media_positions(state))
        adapter = prefill.adapter
        assert adapter is not None
        if req.n > 1 and modalities and not adapter.pd_n_samples:
            raise _n_samples_with_media()
        pair.append((prefill, decode))
        return adapter.plan(state.settings.transport, prefill.labels).device_normalize

    prepared = await state.pipeline.prepare(req, request_id, choose_worker=choose_worker, defer_pixels=True)
    if not pair:  # a text-only request: choose_worker is not called for it
        choose_worker(frozenset(), RoutingKey.text(prepared.input_ids))
    prefill, decode = pair[0]
    assert prefill.adapter is not None and decode.adapter is not None
    assert prefill.client is not None and decode.client is not None
    if prefill.adapter.sequential_pd:
        return await _start_sequential(state, prepared, prefill, decode, record)
    return await _start_together(state, prepared, prefill, decode, record)


async def _prefill_answer(responses: AsyncGenerator[EngineEvent, None]) -> str | None:
    """Read a sequential prefill leg to its end: the ``kv_transfer_params`` its Complete answered (the last
    one), or None."""
    params = None
    try:
        async for event in responses:
            if event.is_complete and event.kv_transfer_params:
                params = event.kv_transfer_params
    finally:
        await responses.aclose()
    return params


async def _start_sequential(state: DispatchContext, prepared: PreparedRequest, prefill: Worker, decode: Worker,
                            record: timing_log.RequestTiming | None) -> EngineAnswer:
    """The vLLM handshake: the prefill leg answered first, its ``kv_transfer_params`` to the decode leg."""
    adapter, decode_adapter = prefill.adapter, decode.adapter
    assert adapter is not None and decode_adapter is not None
    assert prefill.client is not None and decode.client is not None
    timings = prepared.timings_ms
    plan = adapter.plan(state.settings.transport, prefill.labels)
    decode_plan = replace(decode_adapter.plan(state.settings.transport, decode.labels), shm=False)
    language_model_only = decode.caps is not None and decode.caps.language_model_only
    relay = adapter.pd_n_samples or prepared.sampling.n <= 1
    grant = await state.budget.acquire(sum(b.nbytes for b in prepared.batches), prepared.model)
    lease = ShmLease()
    release_decode = decode.hold()

    def release() -> None:
        release_decode()
        lease.release()
        grant.release()

    kv_transfer_params: str | None = None
    try:
        metrics.PROMPT_TOKENS.labels(prepared.model).inc(len(prepared.input_ids))
        if relay:
            release_prefill = prefill.hold(lease.release)
            try:
                with metrics.stage("assemble", timings, prepared.model):
                    prefill_leg = adapter.encode(prepared, Role.PREFILL, plan, lease)
                if prefill_leg.pending:
                    with metrics.stage("preprocess", timings, prepared.model):
                        prefill_leg = await adapter.fill(prefill_leg, prepared, Role.PREFILL, plan, lease)
                start = time.perf_counter()
                kv_transfer_params = await _prefill_answer(prefill.client.generate(prefill_leg, Role.PREFILL))
                timings["engine_prefill"] = (time.perf_counter() - start) * 1000.0
            finally:
                release_prefill()  # the engine has read every tensor (or the leg failed): segments unlinked
            if kv_transfer_params is None and prepared.batches:
                raise GatewayError(ErrorCode.ENGINE_ERROR,
                                   f"prefill worker {prefill.url} answered no kv_transfer_params (is it a KV "
                                   "producer?): the decode leg, which carries no pixels, cannot be served")
        with metrics.stage("assemble", timings, prepared.model):
            decode_leg = decode_adapter.encode(prepared, Role.DECODE, decode_plan, None,
                                               kv_transfer_params=kv_transfer_params,
                                               language_model_only=language_model_only)
        responses = decode.client.generate(decode_leg, Role.DECODE)
    except BaseException:
        release()
        raise
    # both legs have read their tensors once the decode leg has answered
    return await finish(prepared, responses, release, record, router_tally(prepared), answered=(grant.release,))


async def _start_together(state: DispatchContext, prepared: PreparedRequest, prefill: Worker, decode: Worker,
                          record: timing_log.RequestTiming | None) -> EngineAnswer:
    """The SGLang / TokenSpeed handshake: one minted bootstrap on both legs, sent together (and the EPD legs)."""
    request_id = prepared.request_id
    adapter, decode_adapter = prefill.adapter, decode.adapter
    assert adapter is not None and decode_adapter is not None and prefill.client is not None
    assert decode.client is not None
    language_model_only = decode.caps is not None and decode.caps.language_model_only
    timings = prepared.timings_ms
    plan = adapter.plan(state.settings.transport, prefill.labels)
    decode_plan = replace(decode_adapter.plan(state.settings.transport, decode.labels), shm=False)
    host = prefill.target.rpartition(":")[0]
    boot = Bootstrap(host, bootstrap_port(prefill), mint_room())
    grant = await state.budget.acquire(sum(b.nbytes for b in prepared.batches), prepared.model)
    lease = ShmLease()
    release_prefill = prefill.hold()
    release_decode = decode.hold()
    drain: asyncio.Task[None] | None = None
    encodes: list[tuple[Worker, Bootstrap, EncodedRequest]] = []

    def release() -> None:
        release_decode()
        if drain is None or drain.done():
            release_prefill()
            lease.release()
        grant.release()

    try:
        message = prepared
        if not adapter.places_pending or state.settings.epd_disaggregation:
            with metrics.stage("preprocess", timings, prepared.model):
                message = await adapter.materialize(prepared)
        encodes = _encode_legs(state, adapter, message, lease) if state.settings.epd_disaggregation else []
        with metrics.stage("assemble", timings, prepared.model):
            epd = adapter.epd() if encodes else None
            if epd is not None:
                prefill_leg = epd.encode_epd_prefill(message, plan, lease, boot, [b for _, b, _ in encodes])
            else:
                prefill_leg = adapter.encode(message, Role.PREFILL, plan, lease, bootstrap=boot)
            decode_leg = decode_adapter.encode(message, Role.DECODE, decode_plan, None, bootstrap=boot,
                                               language_model_only=language_model_only)
        if prefill_leg.pending:
            with metrics.stage("preprocess", timings, prepared.model):
                await prefill_leg.fill()
        metrics.PROMPT_TOKENS.labels(prepared.model).inc(len(prepared.input_ids))
        prefill_stream = prefill.client.generate(prefill_leg, Role.PREFILL)
        drain = asyncio.create_task(_side(prefill_stream, encodes))

        def prefill_done(task: asyncio.Task[None]) -> None:
            release_prefill()
            lease.release()
            if not task.cancelled() and task.exception() is not None:
                log.warning("prefill/encode legs of %s failed: %s", request_id, task.exception())

        drain.add_done_callback(prefill_done)
        responses = decode.client.generate(decode_leg, Role.DECODE)
    except BaseException:
        if drain is not None:
            drain.cancel()
        release()
        raise
    side = drain

    async def first_or_side_failure() -> EngineEvent:
        """The decode leg's first event; a failed prefill/encode side ends the wait with its error."""
        first_call: asyncio.Task[EngineEvent] = asyncio.ensure_future(anext(responses))
        try:
            await asyncio.wait({first_call, side}, return_when=asyncio.FIRST_COMPLETED)
            if not first_call.done() and side.exception() is not None:
                first_call.cancel()  # an encode or prefill leg failed: the decode leg would wait for a handoff
                raise _side_error(side.exception())
            return await first_call
        except BaseException as exc:
            if not first_call.done():
                first_call.cancel()
            with contextlib.suppress(BaseException):
                await first_call
            failed = side.done() and not side.cancelled() and side.exception() is not None
            if not side.done():
                side.cancel()
            with contextlib.suppress(BaseException):
                await side
            if failed and isinstance(exc, GatewayError):
                raise _side_error(side.exception()) from None  # the prefill's (or encoder's) failure explains it
            raise

    return await finish(prepared, responses, release, record, router_tally(prepared), first=first_or_side_failure,
                        headers={"X-Mmgate-Pd-Room": str(boot.room)})
