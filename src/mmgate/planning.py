"""Planning: what a chat request asks for, checked before anything is fetched; anchor splicing.

Stage: plan (and expand's splice).  In: a validated
:class:`~mmgate.api.protocol.ChatCompletionRequest` and the served model; out: a
:class:`RequestPlan` (template messages + one :class:`~mmgate.types.MediaRef` per
media part), or a refusal.  ``splice_all`` later replaces each anchor of the
tokenized prompt by its placeholder run.  Used by :mod:`mmgate.pipeline`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmgate.api.protocol import AudioPart, ChatCompletionRequest, ImagePart, TextPart, VideoPart
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.fetch import check_scheme
from mmgate.settings import Settings
from mmgate.types import ItemHints, MediaRef, Modality, PlaceholderRange, Replacement

if TYPE_CHECKING:
    from mmgate.pipeline import ModelRuntime


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What planning learned before any byte was fetched."""

    template_messages: list[dict[str, Any]]
    media: tuple[MediaRef, ...]


def plan_request(req: ChatCompletionRequest, runtime: ModelRuntime, settings: Settings) -> RequestPlan:
    """Validate the request's media and map its messages to what the template expects.

    Media parts become ``{"type": "image"}`` / ``{"type": "video"}`` (the
    form transformers processors feed templates; the URL never reaches the
    template).

    Raises:
        GatewayError: MODEL_NOT_FOUND, MULTIMODAL_NOT_SUPPORTED,
            MM_ITEM_LIMIT_EXCEEDED, UNSUPPORTED_MEDIA_URL_SCHEME, INVALID_MEDIA_URL.
    """
    if not runtime.accepts(req.model):
        raise GatewayError(ErrorCode.MODEL_NOT_FOUND, f"model {req.model[:200]!r} is not served here", "model")
    messages: list[dict[str, Any]] = []
    media: list[MediaRef] = []
    for mi, message in enumerate(req.messages):
        msg: dict[str, Any] = {"role": message.role}
        if isinstance(message.content, list):
            parts: list[dict[str, Any]] = []
            for pi, part in enumerate(message.content):
                param = f"messages[{mi}].content[{pi}]"
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                    continue
                hints = ItemHints()
                if isinstance(part, ImagePart):
                    modality, url = Modality.IMAGE, part.image_url.url
                    hints = ItemHints(max_long_side_pixel=part.image_url.max_long_side_pixel)
                elif isinstance(part, VideoPart):
                    modality, url = Modality.VIDEO, part.video_url.url
                    hints = ItemHints(fps=part.video_url.fps, max_long_side_pixel=part.video_url.max_long_side_pixel)
                else:
                    assert isinstance(part, AudioPart)
                    modality, url = Modality.AUDIO, ""
                media.append(MediaRef(modality=modality, url=url, part_index=len(media), param=param, hints=hints))
                parts.append({"type": modality.value})
            msg["content"] = parts
        else:
            msg["content"] = message.content
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            value = getattr(message, key)
            if value is not None:
                msg[key] = value
        messages.append(msg)
    _check_media(media, runtime, settings)
    return RequestPlan(template_messages=messages, media=tuple(media))


def _check_media(media: Sequence[MediaRef], runtime: ModelRuntime, settings: Settings) -> None:
    family = runtime.family
    counts: dict[Modality, int] = {}
    for ref in media:
        counts[ref.modality] = counts.get(ref.modality, 0) + 1
    for modality, count in counts.items():
        if family is None or modality not in family.limits:
            raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                               f"model {runtime.served_name!r} does not accept {modality.value} input",
                               next(r.param for r in media if r.modality is modality))
        limit = settings.item_limits.get(modality.value, family.limits[modality])
        if count > limit:
            raise GatewayError(ErrorCode.MM_ITEM_LIMIT_EXCEEDED,
                               f"{count} {modality.value} items exceed the per-request limit of {limit}", "messages")
    for ref in media:
        check_scheme(ref.url, ref.param)
        if ref.hints.key and family is not None:
            family.check_hints(ref.modality, ref.hints, ref.param)


def hinted(fingerprint: str, hints: ItemHints) -> str:
    """The fingerprint of an item processed under ``hints`` (unchanged when none is set)."""
    return f"{fingerprint}:{hints.key}" if hints.key else fingerprint


def splice_anchors(ids: Sequence[int], anchor_id: int, runs: Sequence[tuple[int, ...]],
                   embed: Sequence[tuple[int, int]]) -> tuple[list[int], list[PlaceholderRange]]:
    """Replace the k-th ``anchor_id`` in ``ids`` by ``runs[k]``.

    ``embed[k]`` = (offset, length) of the embedding range inside ``runs[k]``.

    Example: ``splice_anchors([7, 9, 8], 9, [(5, 5, 5)], [(0, 3)])`` ->
    ``([7, 5, 5, 5, 8], [PlaceholderRange(1, 3)])``.
    """
    out, ranges = splice_all(ids, {anchor_id: [Replacement(r, o, n) for r, (o, n) in zip(runs, embed)]})
    return out, ranges[anchor_id]


def splice_all(ids: Sequence[int], reps: Mapping[int, Sequence[Replacement]]) -> tuple[list[int], dict[int, list[PlaceholderRange]]]:
    """Replace the k-th occurrence of each anchor id ``a`` in ``ids`` by ``reps[a][k]``, in one pass.

    Example: ``splice_all([7, 9, 6, 8], {9: [Replacement((5, 5), 0, 2)], 6: [Replacement((1, 4, 2), 1, 1)]})``
    -> ``([7, 5, 5, 1, 4, 2, 8], {9: [PlaceholderRange(1, 2)], 6: [PlaceholderRange(4, 1)]})``.
    """
    out: list[int] = []
    ranges: dict[int, list[PlaceholderRange]] = {a: [] for a in reps}
    for tok in ids:
        done = ranges.get(tok)
        if done is None:
            out.append(tok)
            continue
        rep = reps[tok][len(done)]
        done.append(PlaceholderRange(offset=len(out) + rep.embed_offset, length=rep.embed_length))
        out.extend(rep.token_ids)
    return out, ranges
