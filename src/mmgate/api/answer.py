"""One engine call for every API shape: a chat request in, the engine's answer stream out.

Stage: select worker -> assemble -> transport -> engine (first response).  In: a validated
:class:`~mmgate.request.protocol.ChatCompletionRequest` (the chat completions endpoint's own, or one that
``/v1/messages`` and ``/v1/responses`` translate their requests into); out: an
:class:`EngineAnswer` whose engine has answered once, so engine refusals surface as HTTP errors
before any byte of a response is sent.  Each endpoint renders the answer in its own shape
(:mod:`mmgate.api.responses` for chat completions).

Router mode refuses media no registered worker takes (:func:`mmgate.api.capability.check_capable`,
before anything is fetched), prepares the request here (plan, render, fetch, preprocess, expand),
picks the worker and has its wire's adapter (:mod:`mmgate.engines.adapter`) write the encoder tensors
straight into their transport buffer; worker mode forwards media references
(:func:`mmgate.api.worker_mode.forward_media_refs`).  The engine's answer arrives as neutral
:class:`~mmgate.engines.base.EngineEvent` values, whatever the wire.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mmgate import metrics, timing_log
from mmgate.api.capability import check_capable
from mmgate.request.protocol import ChatCompletionRequest
from mmgate.engines.adapter import WireAdapter
from mmgate.engines.base import EngineEvent, Role
from mmgate.routing.mm_processing import Mode, decide_request
from mmgate.routing.workers import Worker
from mmgate.transport.policy import WirePlan
from mmgate.transport.shm import ShmLease
from mmgate.types import Modality, PreparedRequest

if TYPE_CHECKING:
    from mmgate.api.app import GatewayState


@dataclass
class EngineAnswer:
    """A request the engine has answered once.

    ``first`` is the engine's first event and ``rest`` the remaining stream (close it with
    ``aclose``); ``release`` frees the worker slot and runs exactly once, when the answer is
    finished or abandoned; ``headers`` are the response headers every shape sends
    (``X-Request-Id``, ``X-Mmgate-Stage-Ms``, ...).
    """

    prepared: PreparedRequest
    first: EngineEvent
    rest: AsyncGenerator[EngineEvent, None]
    release: Callable[[], None]
    headers: dict[str, str]


#: arrays at least this large make encoding worth a trip to the pool
_HEAVY_BYTES = 1 << 20


def _encode_is_heavy(prepared: PreparedRequest) -> bool:
    """Whether encoding copies or writes a large array (then it runs in the pool); a pending tensor costs
    only a segment name or an allocation."""
    for batch in prepared.batches:
        for tensor in batch.tensors.values():
            if isinstance(tensor, np.ndarray) and tensor.nbytes >= _HEAVY_BYTES:
                return True
    return False


def timing_header(timings: dict[str, float]) -> str:
    """``X-Mmgate-Stage-Ms``: ``stage=ms,...``."""
    return ",".join(f"{k}={v:.2f}" for k, v in timings.items())


async def start_chat(state: GatewayState, req: ChatCompletionRequest) -> EngineAnswer:
    """Run ``req`` up to the engine's first response (router or worker mode, as decided for it).

    Observes ``mmgate_time_to_first_token_seconds`` (streamed requests) and the ``engine_first_response``
    stage; with ``--log-mm-timing`` a media request's events and its ``smg_mm_timing`` line are written
    (:mod:`mmgate.timing_log`).

    Raises:
        GatewayError: any refusal of the pipeline, the worker selection or the engine.
    """
    started = time.perf_counter()
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    with timing_log.request_scope(state.settings.log_mm_timing, request_id, state.runtime.served_name) as record:
        answer = await _start(state, req, request_id, record)
    first_s = answer.prepared.timings_ms.get("engine_first_response", 0.0) / 1000.0
    metrics.STAGE_SECONDS.labels("engine_first_response").observe(first_s)
    if req.stream:
        metrics.TTFT_SECONDS.labels(state.runtime.served_name).observe(time.perf_counter() - started)
    return answer


def _router_counts(prepared: PreparedRequest) -> tuple[timing_log.MediaCounts, int]:
    """Items per modality of a router-mode request, and its prompt length before expansion: each item's
    anchor (one token) became its placeholder run, which its range spans in every registered family
    (``Replacement.embed_offset == 0``, ``embed_length == len(token_ids)``)."""
    items = {m: sum(len(b.placeholders) for b in prepared.batches if b.modality is m) for m in Modality}
    run = sum(r.length for b in prepared.batches for r in b.placeholders)
    counts = timing_log.MediaCounts(images=items[Modality.IMAGE], videos=items[Modality.VIDEO],
                                    audios=items[Modality.AUDIO])
    return counts, len(prepared.input_ids) - run + counts.total


async def _start(state: GatewayState, req: ChatCompletionRequest, request_id: str,
                 record: timing_log.RequestTiming | None) -> EngineAnswer:
    from mmgate.api.worker_mode import forward_media_refs

    if state.settings.pd_disaggregation:  # prefill/decode pairs, media processed here (routing/disagg.py)
        from mmgate.routing.disagg import start_pd

        return await start_pd(state, req, request_id, record)
    decision = decide_request(req, state.settings, state.runtime, state.workers.workers)
    if decision is not None and decision.mode is Mode.WORKER:
        return await forward_media_refs(state, req, request_id, record)
    check_capable(state, req)
    chosen: list[tuple[Worker, WireAdapter, WirePlan]] = []

    def choose_worker(modalities: frozenset[Modality]) -> bool:
        worker = state.workers.select(modalities)
        adapter = worker.adapter
        assert adapter is not None  # select() takes only workers of a wire with an adapter
        wire = adapter.plan(state.settings.transport, worker.labels)
        chosen.append((worker, adapter, wire))
        return wire.device_normalize

    prepared = await state.pipeline.prepare(req, request_id, choose_worker=choose_worker, defer_pixels=True)
    worker, adapter, wire = chosen[0]
    timings = prepared.timings_ms
    grant = await state.budget.acquire(sum(b.nbytes for b in prepared.batches))
    lease = ShmLease()
    release = worker.hold(lease.release, grant.release)

    try:
        message = prepared
        if not adapter.places_pending:  # a wire that slices tensors per item: deferred pixels are computed first
            with metrics.stage("preprocess", timings):
                message = await adapter.materialize(prepared)
        with metrics.stage("assemble", timings):
            if _encode_is_heavy(message):
                encoded = await asyncio.get_running_loop().run_in_executor(  # the context: timing events
                    state.executor, contextvars.copy_context().run, adapter.encode, message, Role.SINGLE, wire, lease)
            else:
                encoded = adapter.encode(message, Role.SINGLE, wire, lease)
        if encoded.pending:
            # Deferred pixels: computed now, straight into the segment or the request bytes.
            with metrics.stage("preprocess", timings):
                encoded = await adapter.fill(encoded, message, Role.SINGLE, wire, lease)
        metrics.PROMPT_TOKENS.inc(len(prepared.input_ids))
        assert worker.client is not None
        responses = worker.client.generate(encoded)
    except BaseException:
        release()
        raise
    try:
        start = time.perf_counter()
        first = await anext(responses)
        timings["engine_first_response"] = (time.perf_counter() - start) * 1000.0
    except BaseException:
        release()
        await responses.aclose()
        raise
    # The engine has read every tensor before answering: free the segments and the budget now.
    lease.release()
    grant.release()
    counts, original = _router_counts(prepared)
    timing_log.request_done(record, mode=Mode.ROUTER.value, counts=counts, timings=timings,
                            original_tokens=original, expanded_tokens=len(prepared.input_ids), handed_over=start)
    headers = {"X-Mmgate-Stage-Ms": timing_header(timings), "X-Request-Id": prepared.request_id}
    return EngineAnswer(prepared, first, responses, release, headers)
