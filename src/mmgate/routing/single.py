"""Single-worker dispatch: the whole request to one worker, media processed here (router mode).

Stage: capability check -> prepare -> select worker -> assemble -> transport -> engine (first response).
In: a validated chat request; out: an :class:`~mmgate.routing.dispatch.EngineAnswer`.

Media no registered worker takes are refused before anything is fetched
(:func:`mmgate.routing.capability.check_capable`); the request is prepared (plan, render, fetch,
preprocess, expand), the worker picked while it is (its wire plan decides device normalization), and
its wire's adapter (:mod:`mmgate.engines.adapter`) writes the encoder tensors straight into their
transport buffer.  The shared-memory segments and the in-flight budget are freed once the engine has
answered (it has read every tensor by then); the worker slot when the answer ends.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import TYPE_CHECKING

import numpy as np

from mmgate.observe import metrics, timing_log
from mmgate.engines.adapter import WireAdapter
from mmgate.engines.base import Role
from mmgate.pipeline.routing_key import RoutingKey
from mmgate.routing.capability import check_capable, media_positions
from mmgate.routing.policies.base import RouteRequest
from mmgate.routing.dispatch import Dispatcher, EngineAnswer, finish, router_tally
from mmgate.routing.workers import Worker
from mmgate.transport.policy import WirePlan
from mmgate.transport.shm import ShmLease
from mmgate.types import Modality, PreparedRequest

if TYPE_CHECKING:
    from mmgate.request.protocol import ChatCompletionRequest
    from mmgate.routing.context import DispatchContext

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


class SingleDispatcher(Dispatcher):
    """One worker takes the whole request (see the module docstring)."""

    async def start(self, state: DispatchContext, req: ChatCompletionRequest, request_id: str,
                    record: timing_log.RequestTiming | None) -> EngineAnswer:
        check_capable(state, req)
        chosen: list[tuple[Worker, WireAdapter, WirePlan]] = []

        def choose_worker(modalities: frozenset[Modality], key: RoutingKey) -> bool:
            worker = state.workers.select(modalities, request=RouteRequest.current(key, req.user),
                                          positions=media_positions(state))
            adapter = worker.adapter
            assert adapter is not None  # select() takes only workers of a wire with an adapter
            wire = adapter.plan(state.settings.transport, worker.labels)
            chosen.append((worker, adapter, wire))
            return wire.device_normalize

        prepared = await state.pipeline.prepare(req, request_id, choose_worker=choose_worker, defer_pixels=True)
        worker, adapter, wire = chosen[0]
        timings = prepared.timings_ms
        grant = await state.budget.acquire(sum(b.nbytes for b in prepared.batches), prepared.model)
        lease = ShmLease()
        release = worker.hold(lease.release, grant.release)

        try:
            message = prepared
            if not adapter.places_pending:  # a wire that slices tensors per item: deferred pixels are computed first
                with metrics.stage("preprocess", timings, prepared.model):
                    message = await adapter.materialize(prepared)
            with metrics.stage("assemble", timings, prepared.model):
                if _encode_is_heavy(message):
                    encoded = await asyncio.get_running_loop().run_in_executor(  # the context: timing events
                        state.executor, contextvars.copy_context().run, adapter.encode, message, Role.SINGLE, wire,
                        lease)
                else:
                    encoded = adapter.encode(message, Role.SINGLE, wire, lease)
            if encoded.pending:
                # Deferred pixels: computed now, straight into the segment or the request bytes.
                with metrics.stage("preprocess", timings, prepared.model):
                    encoded = await adapter.fill(encoded, message, Role.SINGLE, wire, lease)
            metrics.PROMPT_TOKENS.labels(prepared.model).inc(len(prepared.input_ids))
            assert worker.client is not None
            responses = worker.client.generate(encoded)
        except BaseException:
            release()
            raise
        # The engine has read every tensor before answering: free the segments and the budget then.
        return await finish(prepared, responses, release, record, router_tally(prepared),
                            answered=(lease.release, grant.release))
