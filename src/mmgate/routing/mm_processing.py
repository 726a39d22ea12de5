"""Where a request's media is processed: here (router) or on the worker (worker).

Stage: right after parsing, before planning.  In: the chat request, the
``--mm-processing`` setting and every registered worker of the model; out: a
:class:`Decision` (mode + reason), counted in
``smg_mm_processing_total{model,mode,reason}``.  docs/media-processing.md
holds the table; the first row that applies wins:

1. ``--mm-processing router``                         -> router, ``config``
2. model not opted in (``--mm-processing-models``)     -> router, ``model_not_opted_in``
3. a media part not forwardable (a hint, a text-level update),
   or ``mm_processor_kwargs`` set                     -> router, ``plan_not_forwardable``
4. ``--mm-processing worker``                         -> worker, ``config``
5. auto, no registered worker advertises a processor  -> router, ``auto_none``
6. auto, every registered worker advertises one       -> worker, ``auto_uniform``
7. auto, some do and some do not                      -> router, ``auto_mixed``

Auto looks at every *registered* worker, healthy or not (labels survive a
failed health check), so a health flap never moves a model between modes.
Requests without media are not decided (nothing to process) and not counted.

The worker path's own checks live here too (an inline ``data:`` URL above the
modality's byte cap, ``media_ref_too_large`` 400 before anything is sent, is
:mod:`mmgate.media.ref_sizes`'s): only a healthy worker that advertises ``mm_processor`` gets references
(``no_healthy_worker`` 503 when none), and only for URL schemes listed in its
``mm_media_ref_schemes`` label (``unsupported_media_url_scheme`` 400).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import blake3
import msgspec

from mmgate.observe import metrics
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.fetch import url_scheme
from mmgate.models.family import Family
from mmgate.request.protocol import AudioPart, AudioURLPart, ChatCompletionRequest, ImagePart, TextPart, VideoPart
from mmgate.engines.base import Role
from mmgate.pipeline.planning import check_anchors
from mmgate.pipeline.routing_key import RoutingKey, expanded_key
from mmgate.routing.policies.base import RouteRequest
from mmgate.routing.workers import Worker, WorkerRegistry
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.config.settings import MmProcessing, Settings
from mmgate.types import MediaRef, Modality

PROCESSOR_LABEL = "mm_processor"
SCHEMES_LABEL = "mm_media_ref_schemes"
#: fields of a media part that are not per-item processing hints (``detail`` is ignored by both paths)
#: (``input_audio.format`` names the container of its ``data``: the worker's decoder sniffs the bytes)
_NOT_HINTS = frozenset({"url", "detail", "format"})


class Mode(StrEnum):
    ROUTER = "router"  # the gateway fetches, preprocesses and expands
    WORKER = "worker"  # the worker gets the unexpanded prompt and media references


class Reason(StrEnum):
    CONFIG = "config"
    MODEL_NOT_OPTED_IN = "model_not_opted_in"
    PLAN_NOT_FORWARDABLE = "plan_not_forwardable"
    AUTO_NONE = "auto_none"
    AUTO_UNIFORM = "auto_uniform"
    AUTO_MIXED = "auto_mixed"


@dataclass(frozen=True, slots=True)
class Decision:
    mode: Mode
    reason: Reason


def struct_hints(obj: msgspec.Struct) -> list[str]:
    """Names of the fields of a media part (recursively) set away from their defaults.

    Any such field is a per-item hint (``max_long_side_pixel``, ``fps``, ...)
    that the worker's processor would not see; ``url`` and ``detail`` are not hints.
    """
    hints: list[str] = []
    names = type(obj).__struct_fields__
    defaults = type(obj).__struct_defaults__  # defaults of the trailing fields (no annotation evaluation)
    first_default = len(names) - len(defaults)
    for i, name in enumerate(names):
        value = getattr(obj, name)
        if isinstance(value, msgspec.Struct):
            hints.extend(f"{name}.{h}" for h in struct_hints(value))
            continue
        if name in _NOT_HINTS or i < first_default:
            continue
        default = defaults[i - first_default]
        factory = getattr(default, "factory", None)  # msgspec's default_factory marker
        if value != (factory() if callable(factory) else default):
            hints.append(name)
    return hints


def media_parts(req: ChatCompletionRequest) -> list[msgspec.Struct]:
    """Every non-text content part, in prompt order."""
    return [part for m in req.messages if isinstance(m.content, list) for part in m.content
            if not isinstance(part, TextPart)]


#: content part type -> the modality of the media reference it is forwarded as (``input_audio`` as a ``data:`` URL)
_FORWARDED: dict[type, Modality] = {ImagePart: Modality.IMAGE, VideoPart: Modality.VIDEO,
                                    AudioPart: Modality.AUDIO, AudioURLPart: Modality.AUDIO}


def forwardable(parts: Iterable[msgspec.Struct], text_updates: frozenset[Modality] = frozenset()) -> bool:
    """Every media part is an image_url, video_url, input_audio or audio_url without hints whose modality's
    prompt updates are made from ids alone (not in the family's ``text_updates``: a text-level update needs the
    prompt text, which media references do not carry)."""
    return all(type(p) in _FORWARDED and not struct_hints(p) and _FORWARDED[type(p)] not in text_updates
               for p in parts)


def model_opted_in(models: tuple[str, ...] | None, runtime: ModelRuntime) -> bool:
    """``--mm-processing-models`` unset: every model; else the served or bundle name must be listed (``*``: all)."""
    if models is None:
        return True
    return "*" in models or runtime.served_name in models or runtime.bundle.name in models


def advertises_processor(worker: Worker) -> bool:
    """Whether the worker said (GetServerInfo ``mm_processor``) that it processes media references."""
    return bool(worker.labels.get(PROCESSOR_LABEL, ""))


def decide(setting: MmProcessing, opted_in: bool, parts_forwardable: bool, workers: Sequence[Worker]) -> Decision:
    """The decision table of the module docstring (pure)."""
    if setting is MmProcessing.ROUTER:
        return Decision(Mode.ROUTER, Reason.CONFIG)
    if not opted_in:
        return Decision(Mode.ROUTER, Reason.MODEL_NOT_OPTED_IN)
    if not parts_forwardable:
        return Decision(Mode.ROUTER, Reason.PLAN_NOT_FORWARDABLE)
    if setting is MmProcessing.WORKER:
        return Decision(Mode.WORKER, Reason.CONFIG)
    capable = sum(1 for w in workers if advertises_processor(w))
    if capable == 0:
        return Decision(Mode.ROUTER, Reason.AUTO_NONE)
    if capable == len(workers):
        return Decision(Mode.WORKER, Reason.AUTO_UNIFORM)
    return Decision(Mode.ROUTER, Reason.AUTO_MIXED)


def decide_request(req: ChatCompletionRequest, settings: Settings, runtime: ModelRuntime,
                   workers: Sequence[Worker]) -> Decision | None:
    """Decide (and count) where ``req``'s media is processed; None for a request without media."""
    parts = media_parts(req)
    if not parts:
        return None
    # Media references carry neither per-item hints, nor the request's processor kwargs, nor the prompt text a
    # text-level update needs: such a request is processed here (router, plan_not_forwardable).
    text_updates = runtime.family.text_updates if runtime.family is not None else frozenset()
    decision = decide(settings.mm_processing, model_opted_in(settings.mm_processing_models, runtime),
                      forwardable(parts, text_updates) and not req.mm_processor_kwargs, workers)
    metrics.MM_PROCESSING.labels(runtime.served_name, decision.mode.value, decision.reason.value).inc()
    return decision


def check_anchor_counts(ids: Sequence[int], refs: Sequence[MediaRef], family: Family | None) -> None:
    """One anchor token per item of each modality, before anything is forwarded
    (:func:`mmgate.pipeline.planning.check_anchors`, the one anchor check).

    Raises:
        GatewayError(MEDIA_COUNT_MISMATCH | MULTIMODAL_NOT_SUPPORTED)
    """
    check_anchors(ids, refs, family)


def check_id_level(refs: Sequence[MediaRef], family: Family | None) -> None:
    """Every item's prompt update can be made from ids alone, before anything is forwarded (a defensive check:
    :func:`decide_request` already sends such requests down the router path): a family's
    text-level updates (``Family.text_updates``: the prompt text re-tokenized with the update in place) need the
    prompt text, which media references do not carry, so the worker would fetch the item and then fail.

    Raises:
        GatewayError(MULTIMODAL_NOT_SUPPORTED): 400, ``param`` naming the first such item.
    """
    if family is None:
        return
    for ref in refs:
        if ref.modality in family.text_updates:
            raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                               f"this model's {ref.modality.value} prompt updates are text-level: they need the prompt "
                               "text, which media references do not carry; use --mm-processing router "
                               "(docs/media-processing.md)", ref.param)


def refs_key(ids: Sequence[int], refs: Sequence[MediaRef], family: Family | None) -> RoutingKey:
    """The routing key of a request whose media the worker fetches (worker mode): the unexpanded prompt with
    each item's anchor keyed by its URL (blake3 of the URL and the item's hints), the gateway knowing neither
    the media's bytes nor its run length."""
    if family is None or not refs:
        return RoutingKey.text(ids)
    runs = {}
    for modality, proc in family.processors.items():
        runs[proc.anchor_token_id] = [
            (blake3.blake3(f"{r.url}|{r.hints}".encode()).hexdigest(), 1) for r in refs if r.modality is modality]
    return expanded_key(ids, runs)


def worker_schemes(worker: Worker) -> frozenset[str]:
    """The URL schemes the worker fetches (its ``mm_media_ref_schemes`` label)."""
    return frozenset(s.strip().lower() for s in worker.labels.get(SCHEMES_LABEL, "").split(",") if s.strip())


def select_processing_worker(registry: WorkerRegistry, refs: Sequence[MediaRef],
                             request: RouteRequest | None = None) -> Worker:
    """The healthy worker that processes media references and fetches every ref's scheme that ``--policy``
    picks for ``request`` (:mod:`mmgate.routing.policies`).

    Raises:
        GatewayError(NO_HEALTHY_WORKER): 503, no healthy worker advertises a media processor.
        GatewayError(UNSUPPORTED_MEDIA_URL_SCHEME): 400, a URL scheme no such worker fetches.
    """
    modalities = {r.modality for r in refs}
    capable = [w for w in registry.workers if w.healthy and advertises_processor(w) and w.accepts_refs(modalities)
               and w.adapter is not None and w.adapter.media_refs]
    if not capable:
        raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, "no healthy worker of this model processes media references")
    schemes = {r.url: url_scheme(r.url) for r in refs}
    fitting = [w for w in capable if set(schemes.values()) <= worker_schemes(w)]
    if not fitting:
        chosen = min(capable, key=lambda w: w.in_flight)
        accepted = worker_schemes(chosen)
        bad = next(r for r in refs if schemes[r.url] not in accepted)
        raise GatewayError(ErrorCode.UNSUPPORTED_MEDIA_URL_SCHEME,
                           f"media URL scheme {schemes[bad.url]!r} is not fetched by the worker "
                           f"(it fetches: {','.join(sorted(accepted)) or 'nothing'})", bad.param)
    chosen = registry.policies[Role.SINGLE].select(fitting, request or RouteRequest())
    assert chosen.client is not None  # healthy implies probed
    return chosen

