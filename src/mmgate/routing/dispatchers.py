"""Which :class:`~mmgate.routing.dispatch.Dispatcher` serves a request.

Stage: dispatch, right after parsing.  In: a validated chat request and the gateway's settings, model and
workers; out: the dispatcher: prefill/decode pairs under ``--pd-disaggregation``
(:class:`~mmgate.routing.disagg.PdDispatcher`), else media references for a worker that processes them
when :func:`mmgate.routing.mm_processing.decide_request` says ``worker``
(:class:`~mmgate.routing.media_refs.MediaRefsDispatcher`), else one worker with the media processed here
(:class:`~mmgate.routing.single.SingleDispatcher`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmgate.routing.disagg import PdDispatcher
from mmgate.routing.dispatch import Dispatcher
from mmgate.routing.media_refs import MediaRefsDispatcher
from mmgate.routing.mm_processing import Mode, decide_request
from mmgate.routing.single import SingleDispatcher

if TYPE_CHECKING:
    from mmgate.request.protocol import ChatCompletionRequest
    from mmgate.routing.context import DispatchContext

SINGLE = SingleDispatcher()
PD = PdDispatcher()
MEDIA_REFS = MediaRefsDispatcher()


def dispatcher_for(state: DispatchContext, req: ChatCompletionRequest) -> Dispatcher:
    """See the module docstring."""
    if state.settings.pd_disaggregation:  # prefill/decode pairs, media processed here
        return PD
    decision = decide_request(req, state.settings, state.runtime, state.workers.workers)
    if decision is not None and decision.mode is Mode.WORKER:
        return MEDIA_REFS
    return SINGLE
