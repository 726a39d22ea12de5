"""One engine call for every API shape: a chat request in, the engine's answer stream out.

Stage: dispatch, as the endpoints call it.  In: a validated
:class:`~mmgate.request.protocol.ChatCompletionRequest` (the chat completions endpoint's own, or one that
``/v1/messages`` and ``/v1/responses`` translate their requests into); out: an
:class:`~mmgate.routing.dispatch.EngineAnswer` whose engine has answered once, so engine refusals surface
as HTTP errors before any byte of a response is sent.  Each endpoint renders the answer in its own shape
(:mod:`mmgate.api.responses` for chat completions).  The request id, the ``--log-mm-timing`` scope and the
first-response metrics are here; the dispatch itself is :mod:`mmgate.routing.dispatch`'s.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from mmgate.observe import metrics, timing_log
from mmgate.routing.dispatchers import dispatcher_for

if TYPE_CHECKING:
    from mmgate.gateway.state import ServedModel
    from mmgate.request.protocol import ChatCompletionRequest
    from mmgate.routing.dispatch import EngineAnswer


async def start_chat(state: ServedModel, req: ChatCompletionRequest) -> EngineAnswer:
    """Run ``req`` up to the engine's first response (router or worker mode, as decided for it) on the served
    model ``state`` its ``model`` names (:meth:`mmgate.gateway.state.GatewayState.model_for`).

    Observes ``mmgate_time_to_first_token_seconds`` (streamed requests) and the ``engine_first_response``
    stage; with ``--log-mm-timing`` a media request's events and its ``smg_mm_timing`` line are written
    (:mod:`mmgate.observe.timing_log`).

    Raises:
        GatewayError: any refusal of the pipeline, the worker selection or the engine.
    """
    started = time.perf_counter()
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    with timing_log.request_scope(state.settings.log_mm_timing, request_id, state.runtime.served_name) as record:
        answer = await dispatcher_for(state, req).start(state, req, request_id, record)
    first_s = answer.prepared.timings_ms.get("engine_first_response", 0.0) / 1000.0
    metrics.STAGE_SECONDS.labels(state.runtime.served_name, "engine_first_response").observe(first_s)
    if req.stream:
        metrics.TTFT_SECONDS.labels(state.runtime.served_name).observe(time.perf_counter() - started)
    return answer
