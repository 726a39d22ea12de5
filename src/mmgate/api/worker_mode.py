"""The worker-side processing path of ``POST /v1/chat/completions``.

Stage: plan -> render+tokenize -> forward checks -> select worker -> engine,
taken when :func:`mmgate.routing.mm_processing.decide_request` says
``worker``.  In: the parsed chat request; out: the HTTP response.

Nothing is fetched here.  The engine message carries the *unexpanded* prompt
(one anchor per item) and the media URLs in prompt order
(``GenerateRequest.media_refs``); the worker fetches, preprocesses and
expands.  Refusals before sending: every planning refusal, the anchor count,
``media_ref_too_large`` (an inline ``data:`` URL above its modality's cap),
``no_healthy_worker`` (no capable worker, 503) and
``unsupported_media_url_scheme`` (a scheme the worker does not fetch).  The
message is the worker's wire adapter's (``encode_media_refs``; vLLM's
``GenerateRequest.media_refs``).  A media error the worker reports comes back
with its own code and status (``engines.rpc_errors.parse_carried_error``) and
the content part it concerns as ``param``.  ``usage.prompt_tokens`` is the
engine's count after expansion.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mmgate import metrics, timing_log
from mmgate.api.answer import EngineAnswer
from mmgate.request.protocol import ChatCompletionRequest
from mmgate.errors import ErrorCode, GatewayError
from mmgate.routing.mm_processing import (
    check_anchor_counts,
    check_ref_sizes,
    select_processing_worker,
)
from mmgate.types import MediaRef, Modality, PreparedRequest

if TYPE_CHECKING:
    from mmgate.api.app import GatewayState


def with_part_param(exc: GatewayError, refs: Sequence[MediaRef]) -> GatewayError:
    """``param = "media_refs[i]"`` (as the engine names an item) -> the request's content part."""
    param = exc.param or ""
    if param.startswith("media_refs[") and param.endswith("]") and param[11:-1].isdigit():
        index = int(param[11:-1])
        if index < len(refs):
            return GatewayError(exc.code, exc.message, refs[index].param)
    return exc


async def forward_media_refs(state: GatewayState, req: ChatCompletionRequest, request_id: str | None = None,
                             record: timing_log.RequestTiming | None = None) -> EngineAnswer:
    """Send ``req`` to a worker that processes its media itself (see the module docstring); the engine
    has answered once when this returns.  ``record``: the request's ``--log-mm-timing`` record (its
    ``process_multimodal_plan`` line is written here, with ``mode=worker``)."""
    timings: dict[str, float] = {}
    pipeline = state.pipeline
    plan, prompt, ids, _ = await pipeline.render_prompt_async(req, timings)
    sampling = pipeline._sampling(req, len(ids))  # the unexpanded length: a lower bound
    refs = plan.media
    with metrics.stage("forward_checks", timings):
        check_anchor_counts(ids, refs, state.runtime.family)
        check_ref_sizes(refs, state.settings.fetch)
        worker = select_processing_worker(state.workers, refs)
    prepared = PreparedRequest(
        request_id=request_id or f"chatcmpl-{uuid.uuid4().hex}", model=state.runtime.served_name, prompt_text=prompt,
        input_ids=tuple(ids), batches=(), sampling=sampling, stream=req.stream, timings_ms=timings)
    adapter = worker.adapter
    if adapter is None:
        raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, "no healthy worker of this model processes media references")
    with metrics.stage("assemble", timings):
        encoded = adapter.encode_media_refs(prepared, refs)
    release = worker.hold()

    assert worker.client is not None
    responses = worker.client.generate(encoded)
    try:
        start = time.perf_counter()
        first = await anext(responses)
        timings["engine_first_response"] = (time.perf_counter() - start) * 1000.0
    except GatewayError as exc:
        release()
        await responses.aclose()
        raise with_part_param(exc, refs) from None
    except BaseException:
        release()
        await responses.aclose()
        raise
    prompt_tokens = first.prompt_tokens
    metrics.PROMPT_TOKENS.inc(prompt_tokens)
    counts = timing_log.MediaCounts(*(sum(1 for r in refs if r.modality is m)
                                      for m in (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO)))
    timing_log.request_done(record, mode="worker", counts=counts, timings=timings, original_tokens=len(ids),
                            expanded_tokens=prompt_tokens, handed_over=start)
    headers = {"X-Mmgate-Stage-Ms": ",".join(f"{k}={v:.2f}" for k, v in timings.items()),
               "X-Request-Id": prepared.request_id, "X-Mmgate-Mm-Processing": "worker"}
    return EngineAnswer(prepared, first, responses, release, headers)
