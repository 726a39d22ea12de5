"""The dispatch layer's one interface: a prepared chat request to an engine, up to its first response.

Stage: dispatch (select worker -> assemble -> transport -> engine).  In: a validated
:class:`~mmgate.request.protocol.ChatCompletionRequest`, its request id and its ``--log-mm-timing`` record;
out: an :class:`EngineAnswer` whose engine has answered once, so engine refusals surface as HTTP errors
before any byte of a response is sent.  One :class:`Dispatcher` per policy: single worker
(:mod:`mmgate.routing.single`), prefill/decode and encode disaggregation (:mod:`mmgate.routing.disagg`),
media references for worker-side processing (:mod:`mmgate.routing.media_refs`); which one serves a
request is :func:`mmgate.routing.dispatchers.dispatcher_for`'s.

Every dispatcher ends in :func:`finish`: wait for the first response (its ``engine_first_response``
stage), release the worker slot and close the stream when that wait fails, free what the engine has read,
write the request's timing line (:func:`mmgate.observe.timing_log.request_done`) and the response headers every
API shape sends (``X-Request-Id``, ``X-Mmgate-Stage-Ms``, a dispatcher's own).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmgate.observe import metrics, timing_log
from mmgate.engines.base import EngineEvent
from mmgate.errors import GatewayError
from mmgate.routing.mm_processing import Mode
from mmgate.types import Modality, PreparedRequest

if TYPE_CHECKING:
    from mmgate.request.protocol import ChatCompletionRequest
    from mmgate.routing.context import DispatchContext


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


class Dispatcher(ABC):
    """One way of sending a request to the engines (see the module docstring)."""

    @abstractmethod
    async def start(self, state: DispatchContext, req: ChatCompletionRequest, request_id: str,
                    record: timing_log.RequestTiming | None) -> EngineAnswer:
        """Run ``req`` up to the engine's first response.

        Raises:
            GatewayError: any refusal of the pipeline, the worker selection or the engine.
        """


@dataclass(frozen=True, slots=True)
class Tally:
    """What a dispatched request's timing line says of it (:func:`mmgate.observe.timing_log.request_done`)."""

    mode: Mode  # router: media processed here; worker: media references forwarded
    counts: timing_log.MediaCounts
    original_tokens: int  # the prompt's length before expansion
    #: after expansion; None: the engine's count (its first response's ``prompt_tokens``), which
    #: :func:`finish` adds to ``mmgate_prompt_tokens``
    expanded_tokens: int | None


def timing_header(timings: Mapping[str, float]) -> str:
    """``X-Mmgate-Stage-Ms``: ``stage=ms,...``."""
    return ",".join(f"{k}={v:.2f}" for k, v in timings.items())


def router_tally(prepared: PreparedRequest) -> Tally:
    """Items per modality of a router-mode request, and its prompt length before expansion: each item's
    anchor (one token) became its placeholder run, which its range spans in every registered family
    (``Replacement.embed_offset == 0``, ``embed_length == len(token_ids)``)."""
    items = {m: sum(len(b.placeholders) for b in prepared.batches if b.modality is m) for m in Modality}
    run = sum(r.length for b in prepared.batches for r in b.placeholders)
    counts = timing_log.MediaCounts(images=items[Modality.IMAGE], videos=items[Modality.VIDEO],
                                    audios=items[Modality.AUDIO])
    return Tally(Mode.ROUTER, counts, len(prepared.input_ids) - run + counts.total, len(prepared.input_ids))


async def finish(prepared: PreparedRequest, responses: AsyncGenerator[EngineEvent, None],
                 release: Callable[[], None], record: timing_log.RequestTiming | None, tally: Tally, *,
                 first: Callable[[], Awaitable[EngineEvent]] | None = None,
                 answered: Sequence[Callable[[], object]] = (), headers: Mapping[str, str] | None = None,
                 refusal: Callable[[GatewayError], GatewayError] | None = None) -> EngineAnswer:
    """The tail of every dispatcher: ``responses``' first event (``first()``, when given, waits for it
    instead: a wait that also watches other legs), timed as ``engine_first_response``.

    On a failed wait, ``release`` runs, ``responses`` is closed and the error is raised (a
    :class:`GatewayError` through ``refusal`` when given).  Once answered, each of ``answered`` runs (what
    the engine has read: segments, budget), the timing line is written and the answer's headers are
    ``X-Mmgate-Stage-Ms``, ``X-Request-Id`` and then ``headers``.
    """
    timings = prepared.timings_ms
    start = time.perf_counter()
    try:
        event = await (first() if first is not None else anext(responses))
        timings["engine_first_response"] = (time.perf_counter() - start) * 1000.0
    except GatewayError as exc:
        release()
        await responses.aclose()
        if refusal is None:
            raise
        raise refusal(exc) from None
    except BaseException:
        release()
        await responses.aclose()
        raise
    for free in answered:
        free()
    expanded = tally.expanded_tokens
    if expanded is None:
        expanded = event.prompt_tokens
        metrics.PROMPT_TOKENS.labels(prepared.model).inc(expanded)
    timing_log.request_done(record, mode=tally.mode.value, counts=tally.counts, timings=timings,
                            original_tokens=tally.original_tokens, expanded_tokens=expanded, handed_over=start)
    return EngineAnswer(prepared, event, responses, release,
                        {"X-Mmgate-Stage-Ms": timing_header(timings), "X-Request-Id": prepared.request_id,
                         **(headers or {})})
