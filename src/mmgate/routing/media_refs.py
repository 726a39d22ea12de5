"""Media-reference dispatch: the worker-side processing path of every chat request (``--mm-processing worker``).

Stage: plan -> render+tokenize -> forward checks -> select worker -> engine,
taken when :func:`mmgate.routing.mm_processing.decide_request` says
``worker``.  In: the parsed chat request; out: an :class:`~mmgate.routing.dispatch.EngineAnswer`.

Nothing is fetched here.  The engine message carries the *unexpanded* prompt
(one anchor per item) and the media URLs in prompt order
(``GenerateRequest.media_refs``); the worker fetches, preprocesses and
expands.  Refusals before sending: every planning refusal, the anchor count,
an item whose prompt update is text-level (``multimodal_not_supported``: it needs
the prompt text, ``Family.text_updates``),
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

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from mmgate.observe import metrics, timing_log
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.ref_sizes import check_ref_sizes
from mmgate.routing.dispatch import Dispatcher, EngineAnswer, Tally, finish
from mmgate.routing.mm_processing import (
    Mode,
    check_anchor_counts,
    check_id_level,
    refs_key,
    select_processing_worker,
)
from mmgate.routing.policies.base import RouteRequest
from mmgate.types import MediaRef, Modality, PreparedRequest

if TYPE_CHECKING:
    from mmgate.request.protocol import ChatCompletionRequest
    from mmgate.routing.context import DispatchContext


def with_part_param(exc: GatewayError, refs: Sequence[MediaRef]) -> GatewayError:
    """``param = "media_refs[i]"`` (as the engine names an item) -> the request's content part."""
    param = exc.param or ""
    if param.startswith("media_refs[") and param.endswith("]") and param[11:-1].isdigit():
        index = int(param[11:-1])
        if index < len(refs):
            return GatewayError(exc.code, exc.message, refs[index].param)
    return exc


class MediaRefsDispatcher(Dispatcher):
    """The request's media forwarded as references to a worker that processes them (see the module
    docstring)."""

    async def start(self, state: DispatchContext, req: ChatCompletionRequest, request_id: str,
                    record: timing_log.RequestTiming | None) -> EngineAnswer:
        """Send ``req`` to a worker that processes its media itself; the engine has answered once when this
        returns.  ``record``: the request's ``--log-mm-timing`` record (its ``process_multimodal_plan`` line
        is written with ``mode=worker``)."""
        timings: dict[str, float] = {}
        pipeline = state.pipeline
        plan, prompt, ids, _ = await pipeline.render_prompt_async(req, timings)
        sampling = pipeline._sampling(req, len(ids))  # the unexpanded length: a lower bound
        refs = plan.media
        with metrics.stage("forward_checks", timings, state.runtime.served_name):
            check_anchor_counts(ids, refs, state.runtime.family)
            check_id_level(refs, state.runtime.family)
            check_ref_sizes(refs, state.settings.fetch)
            key = refs_key(ids, refs, state.runtime.family)
            worker = select_processing_worker(state.workers, refs, RouteRequest.current(key, req.user))
        prepared = PreparedRequest(
            request_id=request_id, model=state.runtime.served_name, prompt_text=prompt,
            input_ids=tuple(ids), batches=(), sampling=sampling, stream=req.stream, timings_ms=timings)
        adapter = worker.adapter
        if adapter is None:
            raise GatewayError(ErrorCode.NO_HEALTHY_WORKER,
                               "no healthy worker of this model processes media references")
        with metrics.stage("assemble", timings, state.runtime.served_name):
            encoded = adapter.encode_media_refs(prepared, refs)
        release = worker.hold()

        assert worker.client is not None
        responses = worker.client.generate(encoded)
        counts = timing_log.MediaCounts(*(sum(1 for r in refs if r.modality is m)
                                          for m in (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO)))
        return await finish(prepared, responses, release, record, Tally(Mode.WORKER, counts, len(ids), None),
                            headers={"X-Mmgate-Mm-Processing": "worker"}, refusal=partial(with_part_param, refs=refs))
