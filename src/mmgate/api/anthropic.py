"""Anthropic Messages API: ``POST /v1/messages`` over the chat pipeline.

Stage: api.  In: an Anthropic Messages body (``system``; ``user``/``assistant`` turns whose content
is a string or ``text`` and ``image`` blocks, the image's ``source`` being ``base64`` or ``url``;
``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``stream``, ``metadata``).
It is translated into a :class:`ChatCompletionRequest` (an image block becomes an ``image_url`` part
with a ``data:`` or ``http(s)`` URL) and answered by :func:`mmgate.api.answer.start_chat`, so it goes
through the same plan, fetch, preprocess, expansion and engine call as a chat completion.  Out: a
``message`` object, or Anthropic's SSE event sequence (``message_start``, ``content_block_start``,
``ping``, ``content_block_delta``/``text_delta`` ..., ``content_block_stop``, ``message_delta``,
``message_stop``).

Invariants: an unknown top-level field (``tools``, ``tool_choice``, ``thinking`` ...) is refused with
400 naming the field, never dropped; every error has Anthropic's body
``{"type": "error", "error": {"type", "message"}}`` with the status and ``X-SMG-Error-Code`` header
of the one error table (:mod:`mmgate.errors`), the Anthropic type chosen by status; a stop sequence
ends the text before it (it is reported in ``stop_sequence``, never in the content), and a streamed
answer holds back the last ``len(longest stop sequence) - 1`` characters until they cannot begin one.

References: the Anthropic Messages API (docs.anthropic.com ``/en/api/messages``,
``/en/docs/build-with-claude/streaming``, ``/en/api/errors``); vLLM
``vllm/entrypoints/anthropic/serving_messages.py`` ``AnthropicServingMessages``
(``_convert_anthropic_to_openai_request``, ``messages_full_converter``, ``message_stream_converter``;
v0.11), whose translation this mirrors, except that a ``base64`` source becomes a real ``data:`` URL.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from tokenizers.decoders import DecodeStream

from mmgate.observe import metrics
from mmgate.api.answer import start_chat
from mmgate.api.disconnect import until_disconnect
from mmgate.api.http import error_response, parse_off_loop, request_body
from mmgate.api.responses import EngineStreamingResponse
from mmgate.errors import ErrorCode, GatewayError
from mmgate.request.protocol import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKENS_LIMIT,
    TOP_K_LIMIT,
    ChatCompletionRequest,
    ContentPart,
    ImagePart,
    ImageURL,
    Message,
    TextPart,
    check_json_depth,
)
from mmgate.routing.dispatch import EngineAnswer

if TYPE_CHECKING:
    from mmgate.chat.tokenizer import BundleTokenizer
    from mmgate.engines.base import EngineEvent
    from mmgate.gateway.state import GatewayState, ServedModel

log = logging.getLogger("mmgate.api")


# ---- request shapes (Anthropic ``MessageCreateParams``) -----------------------------------------

class Base64Source(msgspec.Struct, frozen=True, tag_field="type", tag="base64"):
    media_type: str  # one of IMAGE_MEDIA_TYPES
    data: str  # base64 of the image bytes


class URLSource(msgspec.Struct, frozen=True, tag_field="type", tag="url"):
    url: str


class TextBlock(msgspec.Struct, frozen=True, tag_field="type", tag="text"):
    text: str  # other keys of a block (``cache_control``, ``citations``) are ignored


class ImageBlock(msgspec.Struct, frozen=True, tag_field="type", tag="image"):
    source: Base64Source | URLSource


class AudioBlock(msgspec.Struct, frozen=True, tag_field="type", tag="audio"):
    """Not an Anthropic block (the Messages API has no audio): parsed only to be refused by name
    (``multimodal_not_supported``) instead of as an unknown block type."""


class InputAudioBlock(msgspec.Struct, frozen=True, tag_field="type", tag="input_audio"):
    """The OpenAI chat part sent to the Messages API by mistake: refused by name, as :class:`AudioBlock`."""


class AnthropicMessage(msgspec.Struct, frozen=True):
    role: str  # "user" | "assistant"
    content: str | list[TextBlock | ImageBlock | AudioBlock | InputAudioBlock]


class Metadata(msgspec.Struct, frozen=True):
    user_id: str | None = None  # accepted and ignored


class MessagesRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/messages`` (the fields this gateway carries; any other is refused)."""

    model: str
    messages: list[AnthropicMessage]
    max_tokens: int  # required by the Anthropic API
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None  # Anthropic's range [0, 1]
    top_p: float | None = None
    top_k: int | None = None  # 0: disabled
    stream: bool = False
    metadata: Metadata | None = None


#: the image types the Anthropic API takes in a ``base64`` source
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
#: Anthropic's ``temperature`` range
TEMPERATURE_RANGE = (0.0, 1.0)

_DECODER = msgspec.json.Decoder(MessagesRequest)
_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `(?P<name>[A-Za-z_][A-Za-z0-9_]{0,63})`$")
_SAFE_OPENINGS = ("Expected `", "Object missing required field `", "Number out of range")


def _refuse(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message, param)


def _decode_error(text: str) -> GatewayError:
    """A 400 for a msgspec ``ValidationError`` text, naming the path and never quoting a value.

    An unknown top-level field is named (only when it is a plain identifier); an unknown block or
    source ``type`` gets a message listing the known ones.
    """
    match = _AT_PATH.search(text)
    path = match.group("path").lstrip(".") if match else ""
    what = text[: match.start()] if match else text
    unknown = _UNKNOWN_FIELD.match(what)
    if unknown and not path:
        name = unknown.group("name")
        return _refuse(f"field {name} is not supported on /v1/messages", name)
    if unknown or what.startswith("Object contains unknown field"):
        return _refuse(f"unknown field{' at ' + path if path else ''}", path or None)
    if path.endswith(".source.type"):
        what = "unknown image source type (expected base64 or url)"
    elif path.endswith(".type") and ".content[" in path:
        what = "unsupported content block type (expected text or image)"
    elif not what.startswith(_SAFE_OPENINGS) or len(what) > 120:
        what = "invalid value"
    return _refuse(f"invalid request{' at ' + path if path else ''}: {what}", path or None)


def parse_messages_request(body: bytes) -> MessagesRequest:
    """Decode and check a Messages body.

    Ranges: ``max_tokens`` 1 .. :data:`MAX_TOKENS_LIMIT` (the wire's ``uint32``), ``temperature`` in
    :data:`TEMPERATURE_RANGE`, ``top_p`` in (0, 1], ``top_k`` 0 .. :data:`TOP_K_LIMIT`, at most
    :data:`MAX_STOP_STRINGS` stop sequences of 1 .. :data:`MAX_STOP_CHARS` characters (the chat
    endpoint's bounds), roles ``user``/``assistant``, no empty content list, a ``base64`` image of
    one of :data:`IMAGE_MEDIA_TYPES`.

    Raises:
        GatewayError(INVALID_REQUEST): not JSON, too deeply nested, not the Messages shape, an
            unknown top-level field (named), or a value out of range (``param`` names the field).
    """
    check_json_depth(body)
    try:
        req = _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise _decode_error(str(exc)) from None
    except msgspec.DecodeError:
        raise _refuse("request body is not valid JSON") from None
    except RecursionError:
        raise _refuse("request JSON is nested too deeply") from None
    if not 1 <= req.max_tokens <= MAX_TOKENS_LIMIT:
        raise _refuse(f"max_tokens must be an integer within [1, {MAX_TOKENS_LIMIT}]", "max_tokens")
    low, high = TEMPERATURE_RANGE
    if req.temperature is not None and not low <= req.temperature <= high:
        raise _refuse(f"temperature must be a number within [{low}, {high}]", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise _refuse("top_p must be a number within (0, 1]", "top_p")
    if req.top_k is not None and not 0 <= req.top_k <= TOP_K_LIMIT:
        raise _refuse(f"top_k must be an integer within [0, {TOP_K_LIMIT}]", "top_k")
    stops = req.stop_sequences or []
    if len(stops) > MAX_STOP_STRINGS:
        raise _refuse(f"stop_sequences takes at most {MAX_STOP_STRINGS} strings", "stop_sequences")
    for i, stop in enumerate(stops):
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise _refuse(f"a stop sequence must have 1 to {MAX_STOP_CHARS} characters", f"stop_sequences[{i}]")
    if not req.messages:
        raise _refuse("messages must not be empty", "messages")
    for mi, message in enumerate(req.messages):
        if message.role not in ("user", "assistant"):
            raise _refuse("role must be user or assistant", f"messages[{mi}].role")
        if isinstance(message.content, list) and not message.content:
            raise _refuse("content must not be empty", f"messages[{mi}].content")
        for bi, block in enumerate(message.content if isinstance(message.content, list) else ()):
            if isinstance(block, (AudioBlock, InputAudioBlock)):
                raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                                   "the Messages API has no audio content; send audio to /v1/chat/completions "
                                   "(input_audio or audio_url parts)", f"messages[{mi}].content[{bi}]")
            if isinstance(block, ImageBlock) and isinstance(block.source, Base64Source) \
                    and block.source.media_type not in IMAGE_MEDIA_TYPES:
                raise _refuse("media_type must be one of " + ", ".join(IMAGE_MEDIA_TYPES),
                              f"messages[{mi}].content[{bi}].source.media_type")
    return req


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request of a Messages request (vLLM ``_convert_anthropic_to_openai_request``).

    ``system`` becomes a leading ``system`` message (text blocks concatenated, as vLLM does); a
    ``base64`` image becomes ``data:<media_type>;base64,<data>``; empty text blocks are skipped and
    a list that holds a single text block becomes a plain string, as in vLLM.
    """
    messages: list[Message] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        messages.append(Message(role="system", content=system))
    for message in req.messages:
        if isinstance(message.content, str):
            messages.append(Message(role=message.role, content=message.content))
            continue
        parts: list[ContentPart] = []
        for block in message.content:
            if isinstance(block, TextBlock):
                if block.text:
                    parts.append(TextPart(text=block.text))
            elif not isinstance(block, ImageBlock):
                continue  # audio blocks were refused by validation
            elif isinstance(block.source, Base64Source):
                url = f"data:{block.source.media_type};base64,{block.source.data}"
                parts.append(ImagePart(image_url=ImageURL(url=url)))
            else:
                parts.append(ImagePart(image_url=ImageURL(url=block.source.url)))
        content: str | list[ContentPart] = parts
        if not parts:
            content = ""
        elif len(parts) == 1 and isinstance(parts[0], TextPart):
            content = parts[0].text
        messages.append(Message(role=message.role, content=content))
    return ChatCompletionRequest(model=req.model, messages=messages, stream=req.stream, max_tokens=req.max_tokens,
                                 temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                 stop=list(req.stop_sequences) if req.stop_sequences else None)


# ---- errors ---------------------------------------------------------------------------------------

#: Anthropic ``error.type`` by HTTP status; another 4xx is ``invalid_request_error``, another 5xx
#: ``api_error`` (docs.anthropic.com ``/en/api/errors``; 503 is this gateway's "overloaded")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


#: the Messages route; every path at or under it answers errors in Anthropic's shape
MESSAGES_PATH = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    """Whether errors on ``path`` take Anthropic's shape (``/v1/messages`` and any path under it)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_body(exc: GatewayError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for ``exc`` (its param appended to the message)."""
    kind = ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    message = exc.message if not exc.param or exc.param in exc.message else f"{exc.message} (at {exc.param})"
    return {"type": "error", "error": {"type": kind, "message": message}}


_MESSAGE_INDEX = re.compile(r"^messages\[(\d+)\]")


def _anthropic_param(exc: GatewayError, has_system: bool) -> GatewayError:
    """``exc`` with a chat ``messages[i]`` param renumbered to the Messages request (``system`` was i=0)."""
    match = _MESSAGE_INDEX.match(exc.param or "") if has_system else None
    if match is None or exc.param is None:
        return exc
    i = int(match.group(1))
    param = "system" if i == 0 else f"messages[{i - 1}]" + exc.param[match.end():]
    return GatewayError(exc.code, exc.message.replace(exc.param, param), param)


def anthropic_error_response(exc: GatewayError, render: Callable[[GatewayError], Response]) -> JSONResponse:
    """The Anthropic-shaped response of ``exc``: the status, ``X-SMG-Error-Code`` and ``Retry-After`` of
    ``render`` (the gateway's one rendering, :func:`mmgate.api.http.error_response`, which counts it)."""
    base = render(exc)
    headers = {k: v for k in ("X-SMG-Error-Code", "Retry-After") if (v := base.headers.get(k)) is not None}
    return JSONResponse(anthropic_error_body(exc), status_code=exc.status, headers=headers)


# ---- answers --------------------------------------------------------------------------------------

def _stop_reason(complete: EngineEvent, text: str,
                 stops: list[str]) -> tuple[str, str | None, int]:
    """(``stop_reason``, ``stop_sequence``, length of the text to keep) of a finished answer.

    ``length`` -> ``max_tokens``; a matched stop string that is one of ``stops`` -> ``stop_sequence``
    with the text cut before its first occurrence (vLLM's ``StopChecker.check_stop_strings`` with
    ``include_stop_str_in_output=False``); any other stop -> ``end_turn``.

    Raises:
        GatewayError(ENGINE_ERROR): the engine finished the request with an error.
    """
    if complete.finish_reason == "error":
        raise GatewayError(ErrorCode.ENGINE_ERROR, "engine reported an error finishing the request")
    if complete.finish_reason == "length":
        return "max_tokens", None, len(text)
    matched = complete.matched_stop_str
    if matched and matched in stops:
        cut = text.find(matched)
        return "stop_sequence", matched, cut if cut >= 0 else len(text)
    return "end_turn", None, len(text)


def _prompt_tokens(answer: EngineAnswer, complete: EngineEvent | None = None) -> int:
    """The engine's count of the expanded prompt; our own when the engine reports none."""
    reported = complete.prompt_tokens if complete is not None else 0
    if not reported and not answer.first.is_complete:
        reported = answer.first.prompt_tokens
    return int(reported) or len(answer.prepared.input_ids)


def _message_id(answer: EngineAnswer) -> str:
    return "msg_" + answer.prepared.request_id.rpartition("-")[2]


async def message_body(answer: EngineAnswer, tokenizer: BundleTokenizer, stops: list[str]) -> dict[str, Any]:
    """The ``message`` object of a non-streamed answer (vLLM ``messages_full_converter``)."""
    output: list[int] = []
    event: EngineEvent | None = answer.first
    while event is not None and not event.is_complete:
        output.extend(event.token_ids)
        event = await anext(answer.rest, None)
    if event is None:
        raise GatewayError(ErrorCode.ENGINE_ERROR, "engine stream ended without a completion")
    complete = event
    output = output or list(complete.token_ids)
    text = tokenizer.decode(output)
    reason, stop_sequence, keep = _stop_reason(complete, text, stops)
    metrics.COMPLETION_TOKENS.labels(answer.prepared.model).inc(len(output))
    return {"id": _message_id(answer), "type": "message", "role": "assistant", "model": answer.prepared.model,
            "content": [{"type": "text", "text": text[:keep]}], "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": _prompt_tokens(answer, complete), "output_tokens": len(output)}}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


def _text_delta(text: str) -> bytes:
    return _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": text}})


def _safe_end(text: str, sent: int, hold: int, stops: list[str]) -> int:
    """How far ``text`` may be sent: not into a stop sequence it holds (the engine's ``complete``
    follows and cuts there), nor into its last ``hold`` characters, which may begin one."""
    end = len(text) - hold
    for stop in stops:
        at = text.find(stop, sent)
        if at >= 0:
            end = min(end, at)
    return end


async def message_events(answer: EngineAnswer, tokenizer: BundleTokenizer, stops: list[str]) -> AsyncIterator[bytes]:
    """Anthropic's SSE events of a streamed answer (vLLM ``message_stream_converter``).

    Text is detokenized incrementally (``tokenizers``' ``DecodeStream``); with stop sequences the
    last ``len(longest) - 1`` characters wait until the next token or the end, and nothing from a
    stop sequence on is sent (:func:`_safe_end`).  An engine failure after the first event becomes an
    ``error`` event and ends the stream; ``answer.release`` runs exactly once.
    """
    decoder = DecodeStream(skip_special_tokens=True)
    hold = max((len(s) for s in stops), default=1) - 1
    text, sent, count = "", 0, 0
    try:
        yield _event("message_start", {"type": "message_start", "message": {
            "id": _message_id(answer), "type": "message", "role": "assistant", "model": answer.prepared.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": _prompt_tokens(answer), "output_tokens": 0}}})
        yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}})
        yield _event("ping", {"type": "ping"})
        event: EngineEvent | None = answer.first
        while event is not None:
            if not event.is_complete or count == 0:
                for tok in event.token_ids:
                    count += 1
                    text += decoder.step(tokenizer.tokenizer, tok) or ""
            if event.is_complete:
                reason, stop_sequence, keep = _stop_reason(event, text, stops)
                if keep > sent:
                    yield _text_delta(text[sent:keep])
                yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
                yield _event("message_delta", {
                    "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                    "usage": {"input_tokens": _prompt_tokens(answer, event), "output_tokens": count}})
                yield _event("message_stop", {"type": "message_stop"})
                break
            safe = _safe_end(text, sent, hold, stops)
            if safe > sent:
                yield _text_delta(text[sent:safe])
                sent = safe
            event = await anext(answer.rest, None)
        else:
            raise GatewayError(ErrorCode.ENGINE_ERROR, "engine stream ended without a completion")
        metrics.COMPLETION_TOKENS.labels(answer.prepared.model).inc(count)
    except GatewayError as exc:
        metrics.ERRORS.labels(exc.code.value).inc()
        yield _event("error", anthropic_error_body(exc))
    finally:
        answer.release()
        await answer.rest.aclose()


async def answer_messages(state: ServedModel, req: MessagesRequest) -> Response:
    """Run ``req`` through :func:`start_chat` and render the answer (SSE or one ``message``)."""
    answer = await start_chat(state, to_chat_request(req))
    stops = list(req.stop_sequences or ())
    headers = {**answer.headers, "request-id": answer.headers.get("X-Request-Id", "")}
    tokenizer = state.runtime.tokenizer
    if req.stream:
        return EngineStreamingResponse(message_events(answer, tokenizer, stops), answer.release, answer.rest,
                                       headers)
    try:
        body = await message_body(answer, tokenizer, stops)
    finally:
        answer.release()
        await answer.rest.aclose()
    return JSONResponse(body, headers=headers)


def register_anthropic(app: FastAPI, state: GatewayState, body_limit: int) -> None:
    """Add ``POST /v1/messages`` to ``app``.

    The ``anthropic-version`` and ``x-api-key`` headers are accepted and ignored.  Every failure,
    unexpected ones included (500 ``api_error``, logged), is answered in Anthropic's error shape.
    """
    @app.post(MESSAGES_PATH)
    async def messages(request: Request) -> Response:
        has_system = False
        try:
            async with request_body(state, request, body_limit) as body:
                req = await parse_off_loop(state, parse_messages_request, body.data)
                has_system = bool(req.system)
                served = state.model_for(req.model)
                metrics.REQUESTS.labels(served.name, str(req.stream).lower()).inc()
                return body.answer(await until_disconnect(request, answer_messages(served, req)))
        except GatewayError as exc:
            return anthropic_error_response(_anthropic_param(exc, has_system), error_response)
        except Exception:
            log.exception("internal error")
            return anthropic_error_response(GatewayError(ErrorCode.INTERNAL_ERROR, "internal error"), error_response)
