"""Planning: what a chat request asks for, checked before anything is fetched; anchor splicing.

Stage: plan (and expand's splice).  In: a validated
:class:`~mmgate.request.protocol.ChatCompletionRequest` and the served model; out: a
:class:`RequestPlan` (template messages + one :class:`~mmgate.types.MediaRef` per
media part), or a refusal.  ``splice_all`` later replaces each anchor of the
tokenized prompt by its placeholder run.  Used by :mod:`mmgate.pipeline.prepare`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmgate.request.protocol import (
    AudioPart,
    AudioURLPart,
    ChatCompletionRequest,
    ImageEmbedsPart,
    ImagePart,
    Message,
    TextPart,
    ToolCall,
    VideoPart,
)
from mmgate.chat.template import content_format
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.fetch import check_scheme
from mmgate.models.family import processor
from mmgate.config.settings import Settings
from mmgate.types import ItemHints, MediaRef, Modality, PlaceholderRange, Replacement

if TYPE_CHECKING:
    from mmgate.models.family import Family
    from mmgate.pipeline.runtime import ModelRuntime


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """What planning learned before any byte was fetched."""

    template_messages: list[dict[str, Any]]
    media: tuple[MediaRef, ...]


def plan_request(req: ChatCompletionRequest, runtime: ModelRuntime, settings: Settings) -> RequestPlan:
    """Validate the request's media and map its messages to what the template expects.

    Media parts become ``{"type": "image"}`` / ``{"type": "video"}`` (the
    form transformers processors feed templates; the URL never reaches the
    template).  The other fields follow vLLM's message parsing
    (``vllm/entrypoints/chat_utils.py`` ``_parse_chat_message_content`` and
    ``_postprocess_messages``, v0.11), see :func:`_template_message`.

    Raises:
        GatewayError: MODEL_NOT_FOUND (the name is not quoted), INVALID_REQUEST
            (``chat_template_kwargs`` naming a special token), MULTIMODAL_NOT_SUPPORTED,
            MM_ITEM_LIMIT_EXCEEDED, UNSUPPORTED_MEDIA_URL_SCHEME, INVALID_MEDIA_URL.
    """
    if not runtime.accepts(req.model):
        raise GatewayError(ErrorCode.MODEL_NOT_FOUND, "the requested model is not served here (see GET /v1/models)",
                           "model")
    kwargs = req.chat_template_kwargs
    if kwargs and not runtime.tokenizer.special_tokens.keys().isdisjoint(kwargs):
        raise GatewayError(ErrorCode.INVALID_REQUEST, "chat_template_kwargs may not override the tokenizer's "
                           "special tokens", "chat_template_kwargs")
    messages: list[dict[str, Any]] = []
    media: list[MediaRef] = []
    options = tuple(sorted((req.mm_processor_kwargs or {}).items()))
    template, chosen = runtime.bundle.chat_template, settings.chat_template_content_format
    parts_format = chosen == "openai" or (chosen == "auto" and template is not None
                                          and content_format(template) == "openai")
    for mi, message in enumerate(req.messages):
        msg: dict[str, Any] = {}
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
                    hints = ItemHints(max_long_side_pixel=part.image_url.max_long_side_pixel, options=options)
                elif isinstance(part, VideoPart):
                    modality, url = Modality.VIDEO, part.video_url.url
                    hints = ItemHints(fps=part.video_url.fps, max_long_side_pixel=part.video_url.max_long_side_pixel,
                                      options=options)
                elif isinstance(part, ImageEmbedsPart):
                    raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                                       "image_embeds parts are not accepted: no engine wire carries them", param)
                elif isinstance(part, AudioURLPart):
                    modality, url = Modality.AUDIO, part.audio_url.url
                    hints = ItemHints(options=options)
                else:
                    assert isinstance(part, AudioPart)
                    modality, url = Modality.AUDIO, part.input_audio.data_url()
                    hints = ItemHints(options=options)
                media.append(MediaRef(modality=modality, url=url, part_index=len(media), param=param, hints=hints))
                parts.append({"type": modality.value})
            msg["content"] = parts
        else:
            msg["content"] = message.content
        messages.append(_template_message(message, msg.get("content"), parts_format))
    _check_media(media, runtime, settings)
    return RequestPlan(template_messages=messages, media=tuple(media))


def _template_message(message: Message, content: str | list[dict[str, Any]] | None,
                      parts_format: bool = False) -> dict[str, Any]:
    """One message as the chat template sees it (``content`` already mapped), as vLLM builds it.

    Mirrors vLLM ``vllm/entrypoints/chat_utils.py`` (v0.11)
    ``_parse_chat_message_content`` and ``_postprocess_messages``:

    * with a template that loops over content parts (``parts_format``: vLLM's detected content
      format ``openai``, :func:`mmgate.chat.template.content_format`), a string ``content``
      becomes one text part and ``null`` no parts, as vLLM passes them (LLaVA's templates read
      only parts: a string would be dropped or refused); tool messages excepted (below);
    * otherwise ``content: null`` becomes ``""`` (vLLM's string format);
    * ``tool_calls`` are kept on assistant messages only, an empty list is
      dropped, and each ``function.arguments`` JSON string is parsed into an
      object (not JSON, or absent: ``{}``), as tool-use templates expect;
    * ``tool_call_id`` is kept on tool messages only; a tool message whose parts
      are all text becomes the parts' texts joined by newlines;
    * ``reasoning_content`` is kept on assistant messages only; ``name`` on any;
    * roles pass through unchanged (``developer`` included, as vLLM passes it).
    """
    role = message.role
    if parts_format and role != "tool" and not isinstance(content, list):
        content = [{"type": "text", "text": content}] if content is not None else []
    msg: dict[str, Any] = {"role": role, "content": "" if content is None else content}
    if role == "assistant":
        if message.tool_calls:
            msg["tool_calls"] = [_tool_call(call) for call in message.tool_calls]
        if message.reasoning_content is not None:
            msg["reasoning_content"] = message.reasoning_content
    elif role == "tool":
        if message.tool_call_id is not None:
            msg["tool_call_id"] = message.tool_call_id
        if isinstance(content, list) and all(part.get("type") == "text" for part in content):
            msg["content"] = "\n".join(part["text"] for part in content)
    if message.name is not None:
        msg["name"] = message.name
    return msg


def _tool_call(call: ToolCall) -> dict[str, Any]:
    """A tool call as a template expects it: ``arguments`` an object (vLLM ``_postprocess_messages``).

    The arguments string is bounded in nesting by ``parse_chat_request`` before it is parsed here.
    """
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:  # not JSON (JSONDecodeError), or an integer past Python's digit limit
            arguments = {}
    if not isinstance(arguments, (dict, list)):
        arguments = {}
    out: dict[str, Any] = {"type": call.type, "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        out["id"] = call.id
    return out


def _check_media(media: Sequence[MediaRef], runtime: ModelRuntime, settings: Settings) -> None:
    family = runtime.family
    counts: dict[Modality, int] = {}
    for ref in media:
        counts[ref.modality] = counts.get(ref.modality, 0) + 1
    for modality, count in counts.items():
        if family is None or modality not in family.processors or modality not in family.limits:
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
            processor(family, ref.modality).check_hints(ref.hints, ref.param)


def check_anchors(ids: Sequence[int], refs: Sequence[MediaRef], family: Family | None) -> None:
    """One anchor token per item, for every modality the family takes (none of a modality: no anchor of it).

    The one anchor check, before anything is fetched: the pipeline (router mode) and worker-side forwarding
    (:mod:`mmgate.routing.mm_processing`) both call it.

    Raises:
        GatewayError(MULTIMODAL_NOT_SUPPORTED): items for a text-only model, or of a modality the family does
            not take here.
        GatewayError(MEDIA_COUNT_MISMATCH): a modality whose anchors in ``ids`` and items differ in number.
    """
    if family is None:
        if refs:
            raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, "this model takes no media input", refs[0].param)
        return
    for ref in refs:
        processor(family, ref.modality)  # refuses a modality the family does not take
    for modality, proc in family.processors.items():
        items = sum(1 for r in refs if r.modality is modality)
        found = sum(1 for t in ids if t == proc.anchor_token_id)
        if found != items:
            raise GatewayError(ErrorCode.MEDIA_COUNT_MISMATCH,
                               f"the prompt has {found} {modality.value} anchors for {items} {modality.value}s",
                               "messages")


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


def splice_text(segments: Sequence[tuple[str, bool]],
                texts: Mapping[str, Sequence[str]]) -> list[tuple[str, bool]]:
    """The prompt's ``(text, typed)`` pieces with the k-th occurrence of each anchor string ``a`` in
    template text replaced by ``texts[a][k]`` (caller text, ``typed``, is never touched): the
    text-level prompt update of a reference processor that edits the prompt string before
    tokenizing (transformers 5.24 ``Gemma3Processor.__call__``: ``text.replace(boi_token, ...)``).

    Raises:
        GatewayError(INTERNAL_ERROR): the template text holds fewer anchors than replacements.
    """
    used = dict.fromkeys(texts, 0)
    pattern = re.compile("|".join(re.escape(a) for a in sorted(texts, key=len, reverse=True)))

    def replace(match: re.Match[str]) -> str:
        anchor = match.group(0)
        k = used[anchor]
        if k >= len(texts[anchor]):
            raise GatewayError(ErrorCode.INTERNAL_ERROR, "more anchors in the prompt than items")
        used[anchor] = k + 1
        return texts[anchor][k]

    out = [(text if typed else pattern.sub(replace, text), typed) for text, typed in segments]
    if any(used[a] != len(texts[a]) for a in texts):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, "fewer anchors in the prompt text than items")
    return out


def locate_text_items(ids: Sequence[int], embed_id: int, reps: Sequence[Replacement]) -> list[PlaceholderRange]:
    """Placeholder ranges of text-level updates in the re-tokenized prompt: item k owns the next
    ``reps[k].embed_length`` tokens equal to ``embed_id`` (in prompt order); its range runs from
    ``embed_offset`` tokens before its first to ``trail`` tokens after its last.

    Example: ``locate_text_items([1, 8, 5, 5, 9, 2], 5, [Replacement((), 1, 2, "x", 1)])`` ->
    ``[PlaceholderRange(1, 4)]``.

    Raises:
        GatewayError(INTERNAL_ERROR): the prompt holds a different number of embedding tokens.
    """
    positions = [i for i, t in enumerate(ids) if t == embed_id]
    if len(positions) != sum(r.embed_length for r in reps):
        raise GatewayError(ErrorCode.INTERNAL_ERROR, "the expanded prompt's embedding tokens disagree with the plan")
    out: list[PlaceholderRange] = []
    at = 0
    for rep in reps:
        first, last = positions[at], positions[at + rep.embed_length - 1]
        start = first - rep.embed_offset
        out.append(PlaceholderRange(offset=start, length=last + rep.trail - start + 1))
        at += rep.embed_length
    return out


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
