"""OpenAI Responses API: ``POST /v1/responses`` over the chat pipeline.

Stage: api.  In: a Responses request body (``model``, ``input`` as a plain string or a list of
message items whose content is a string or ``input_text`` / ``input_image`` / ``output_text``
parts, ``instructions``, ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``); out: a
``response`` object, or its SSE event sequence (``response.created`` ... ``response.completed``,
every event with a ``sequence_number``).  The request is translated into a
:class:`~mmgate.request.protocol.ChatCompletionRequest` (``instructions`` -> a leading system message,
``input_image`` -> an ``image_url`` part, ``max_output_tokens`` -> ``max_tokens``) and answered by
:func:`mmgate.api.answer.start_chat`, so planning, media intake, preprocessing and the engine call
are the chat endpoint's own and ``usage.input_tokens`` equals the chat ``prompt_tokens`` of the same
conversation.  The text is detokenized by the chat endpoint's :class:`~mmgate.api.choice_text.ChoiceText`
(vLLM's incremental detokenizer), so streamed and whole answers agree with the chat endpoint's.

Invariants: every top-level field, item type and part type outside the supported set is refused
with 400 ``invalid_request`` naming it (``store`` is accepted and ignored: nothing is stored, as
vLLM does without ``VLLM_ENABLE_RESPONSES_API_STORE``; ``metadata`` is echoed back, within OpenAI's
bounds: :data:`MAX_METADATA_KEYS` keys of at most :data:`MAX_METADATA_KEY_CHARS` characters, string
values of at most :data:`MAX_METADATA_VALUE_CHARS`); errors of the pipeline name the Responses field
(``input[0].content[1].image_url``), not the chat one.  ``instructions`` is bounded by the context
only (its system message counts in the prompt), so a stream echoes it once, in its last event
(``response.created`` and ``response.in_progress`` carry ``instructions: null``): the streamed bytes
never grow with a multiple of the request.  A
generation cut by the token limit is ``status: "incomplete"`` with
``incomplete_details.reason == "max_output_tokens"`` (streamed: ``response.incomplete``).

Shapes mirror openai-python 3.57 ``openai/types/responses`` (``Response``,
``ResponseOutputMessage``, ``ResponseOutputText``, ``ResponseUsage`` and the stream events) and
vLLM's ``vllm/entrypoints/openai/responses/serving.py`` (``responses_full_generator``: finish
reason ``length`` -> incomplete; ``store`` silently off).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mmgate.observe import metrics
from mmgate.api.answer import start_chat
from mmgate.api.choice_text import ChoiceText
from mmgate.api.disconnect import until_disconnect
from mmgate.api.http import parse_off_loop, request_body
from mmgate.api.responses import EngineStreamingResponse
from mmgate.errors import ErrorCode, GatewayError
from mmgate.request.protocol import (
    MAX_TOKENS_LIMIT,
    TEMPERATURE_RANGE,
    AudioPart,
    ChatCompletionRequest,
    ContentPart,
    ImagePart,
    ImageURL,
    InputAudio,
    Message,
    TextPart,
    check_json_depth,
)
from mmgate.routing.dispatch import EngineAnswer

if TYPE_CHECKING:
    from mmgate.chat.tokenizer import BundleTokenizer
    from mmgate.engines.base import EngineEvent
    from mmgate.gateway.state import GatewayState, ServedModel


# ---- request shapes --------------------------------------------------------------------------


class InputText(msgspec.Struct, frozen=True, tag_field="type", tag="input_text"):
    """``{"type": "input_text", "text"}`` (openai-python ``ResponseInputTextParam``) -> a chat ``text`` part."""

    text: str


class InputImage(msgspec.Struct, frozen=True, tag_field="type", tag="input_image"):
    """``{"type": "input_image", "image_url", "detail"?}`` (openai-python ``ResponseInputImageParam``) -> a chat
    ``image_url`` part."""

    image_url: str | None = None  # http(s) URL or data: URL
    file_id: str | None = None  # refused: there is no file store
    detail: str | None = None  # passed on as the chat part's ``detail``


class InputAudioItem(msgspec.Struct, frozen=True):
    """``input_audio`` of an ``input_audio`` part (openai-python ``ResponseInputAudioParam.InputAudio``)."""

    data: str  # base64 bytes
    format: str = "wav"  # "mp3" | "wav" in OpenAI's shape; the chat part's formats are taken


class InputAudioPart(msgspec.Struct, frozen=True, tag_field="type", tag="input_audio"):
    """``{"type": "input_audio", "input_audio": {"data", "format"}}`` (openai-python ``ResponseInputAudioParam``)
    -> a chat ``input_audio`` part."""

    input_audio: InputAudioItem


class OutputText(msgspec.Struct, frozen=True, tag_field="type", tag="output_text"):
    """An earlier answer passed back in an assistant item (annotations and logprobs are dropped)."""

    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


InputPart = InputText | InputImage | InputAudioPart | OutputText


class InputMessage(msgspec.Struct, frozen=True):
    """A message item: openai-python ``EasyInputMessageParam`` / ``ResponseInputItemParam.Message``."""

    role: str  # one of ROLES
    content: str | list[InputPart]
    type: str = "message"
    id: str | None = None  # an earlier output item's id (ignored)
    status: str | None = None  # an earlier output item's status (ignored)


class TextFormat(msgspec.Struct, frozen=True):
    """``text.format``: only ``{"type": "text"}`` (the default) is carried."""

    type: str


class TextConfig(msgspec.Struct, frozen=True):
    """``text`` (openai-python ``ResponseTextConfigParam``)."""

    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, frozen=True):
    """The supported subset of openai-python ``ResponseCreateParams``."""

    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # accepted and ignored: nothing is stored
    metadata: dict[str, str] | None = None  # echoed back
    text: TextConfig | None = None  # only {"format": {"type": "text"}}
    truncation: str | None = None  # only "disabled"


#: item roles (openai-python ``EasyInputMessageParam.role``)
ROLES = ("user", "assistant", "system", "developer")
FIELDS = frozenset(ResponsesRequest.__struct_fields__)
PART_TYPES = ("input_text", "input_image", "input_audio", "output_text")
#: a caller's field name is quoted in a refusal only when it looks like one (never a payload)
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
#: ``metadata`` bounds (OpenAI's ``Metadata``: up to 16 key-value pairs, keys up to 64 characters, string values
#: up to 512 characters)
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def _refuse(message: str, param: str | None) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message, param)


def _named(kind: str, name: object, param: str) -> GatewayError:
    """A refusal of an unsupported field / item type / part type, naming it when it is a plain name."""
    if isinstance(name, str) and _FIELD_NAME.fullmatch(name):
        return _refuse(f"{kind} {name} is not supported by /v1/responses", param)
    return _refuse(f"an unsupported {kind} was given", None if kind == "field" else param)


def _check_shape(raw: Any) -> None:
    """Refuse what the subset does not carry, by name, before structural decoding.

    Raises:
        GatewayError(INVALID_REQUEST): an unknown top-level field (``param`` the field), an item
            whose ``type`` is not ``message``, a role outside :data:`ROLES`, a part type outside
            :data:`PART_TYPES` (``output_text`` only in assistant items).
    """
    if not isinstance(raw, dict):
        raise _refuse("the request body must be a JSON object", None)
    for key in raw:
        if key not in FIELDS:
            raise _named("field", key, str(key))
    _check_metadata(raw.get("metadata"))
    items = raw.get("input")
    if not isinstance(items, list):
        return
    if not items:
        raise _refuse("input must not be empty", "input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue  # refused by the decoder with its path
        kind = item.get("type", "message")
        if kind != "message":
            raise _named("input item type", kind, f"input[{i}].type")
        role = item.get("role")
        if isinstance(role, str) and role not in ROLES:
            raise _refuse(f"role must be one of {', '.join(ROLES)}", f"input[{i}].role")
        content = item.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            ptype = part.get("type") if isinstance(part, dict) else None
            if ptype not in PART_TYPES:
                raise _named("content part type", ptype, f"input[{i}].content[{j}].type")
            if ptype == "output_text" and role != "assistant":
                raise _refuse("output_text parts belong to assistant items", f"input[{i}].content[{j}].type")


def _check_metadata(metadata: Any) -> None:
    """OpenAI's bounds of ``metadata`` (``param`` is ``metadata``: a caller's key is never quoted).

    Raises:
        GatewayError(INVALID_REQUEST): not an object, more than :data:`MAX_METADATA_KEYS` keys, a key longer
            than :data:`MAX_METADATA_KEY_CHARS` characters, a value that is not a string (OpenAI refuses
            numbers and booleans too) or longer than :data:`MAX_METADATA_VALUE_CHARS` characters.
    """
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise _refuse("metadata must be an object of string values", "metadata")
    if len(metadata) > MAX_METADATA_KEYS:
        raise _refuse(f"metadata takes at most {MAX_METADATA_KEYS} keys", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise _refuse(f"a metadata key takes at most {MAX_METADATA_KEY_CHARS} characters", "metadata")
        if not isinstance(value, str):
            raise _refuse("metadata values must be strings", "metadata")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise _refuse(f"a metadata value takes at most {MAX_METADATA_VALUE_CHARS} characters", "metadata")


_AT_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_SAFE_OPENINGS = ("Expected `", "Object missing required field `", "Number out of range")


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Decode and validate a Responses body (the nesting bound of the chat endpoint first).

    Raises:
        GatewayError(INVALID_REQUEST): not JSON, too deep, an unsupported field or type
            (:func:`_check_shape`), not the Responses shape, or a value out of range; ``param`` is
            the JSON path and the message never quotes a value.
    """
    check_json_depth(body)
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise _refuse("request body is not valid JSON", None) from None
    except RecursionError:
        raise _refuse("request JSON is nested too deeply", None) from None
    _check_shape(raw)
    try:
        req = msgspec.convert(raw, ResponsesRequest)
    except msgspec.ValidationError as exc:
        match = _AT_PATH.search(str(exc))
        path = match.group("path").lstrip(".") if match else ""
        what = str(exc)[: match.start()] if match else str(exc)
        if not what.startswith(_SAFE_OPENINGS) or len(what) > 120:
            what = "invalid value"
        raise _refuse(f"invalid request at {path or 'body'}: {what}", path or None) from None
    _check_values(req)
    return req


def _check_values(req: ResponsesRequest) -> None:
    """Ranges as the chat endpoint's (:mod:`mmgate.request.protocol`), under the Responses names.

    Raises:
        GatewayError(INVALID_REQUEST): the first field out of range or unsupported, named in ``param``.
    """
    if req.max_output_tokens is not None and not 1 <= req.max_output_tokens <= MAX_TOKENS_LIMIT:
        raise _refuse(f"max_output_tokens must be an integer within [1, {MAX_TOKENS_LIMIT}]", "max_output_tokens")
    low, high = TEMPERATURE_RANGE
    if req.temperature is not None and not low <= req.temperature <= high:
        raise _refuse(f"temperature must be a number within [{low}, {high}]", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise _refuse("top_p must be a number within (0, 1]", "top_p")
    if req.text is not None and req.text.format is not None and req.text.format.type != "text":
        raise _refuse("only text.format type text is supported by /v1/responses", "text.format.type")
    if req.truncation not in (None, "disabled"):
        raise _refuse("only truncation disabled is supported by /v1/responses", "truncation")
    for i, item in enumerate(req.input if isinstance(req.input, list) else ()):
        for j, part in enumerate(item.content if isinstance(item.content, list) else ()):
            if isinstance(part, InputImage) and part.image_url is None:
                param = f"input[{i}].content[{j}]"
                raise _refuse("input_image needs image_url (file_id is not supported)",
                              param + (".file_id" if part.file_id is not None else ".image_url"))


# ---- translation -----------------------------------------------------------------------------


def to_chat_request(req: ResponsesRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat request answering ``req``, and for each chat message the Responses field it came from.

    ``instructions`` becomes a leading ``system`` message (as vLLM's ``construct_input_messages``,
    ``vllm/entrypoints/openai/responses/utils.py``); a plain string ``input`` one ``user`` message;
    ``input_text`` / ``output_text`` a ``text`` part, ``input_image`` an ``image_url`` part.
    """
    messages: list[Message] = []
    origins: list[str] = []
    if req.instructions is not None:
        messages.append(Message(role="system", content=req.instructions))
        origins.append("instructions")
    if isinstance(req.input, str):
        messages.append(Message(role="user", content=req.input))
        origins.append("input")
    else:
        for i, item in enumerate(req.input):
            content: str | list[ContentPart]
            if isinstance(item.content, str):
                content = item.content
            else:
                content = [_chat_part(part) for part in item.content]
            messages.append(Message(role=item.role, content=content))
            origins.append(f"input[{i}]")
    chat = ChatCompletionRequest(model=req.model, messages=messages, stream=req.stream,
                                 max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p)
    return chat, origins


def _chat_part(part: InputPart) -> ContentPart:
    """One Responses content part as the chat part it stands for."""
    if isinstance(part, InputImage):
        return ImagePart(ImageURL(url=part.image_url or "", detail=part.detail))
    if isinstance(part, InputAudioPart):
        return AudioPart(InputAudio(data=part.input_audio.data, format=part.input_audio.format))
    return TextPart(part.text)


_CHAT_PARAM = re.compile(r"^messages\[(?P<index>\d+)\](?P<rest>.*)$")


def responses_param(param: str | None, origins: list[str]) -> str | None:
    """A chat-request ``param`` (``messages[1].content[0].image_url.url``) renamed to the Responses
    field it came from (``input[0].content[0].image_url``)."""
    if param is None:
        return None
    if param in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if param == "messages":
        return "input"
    match = _CHAT_PARAM.match(param)
    if not match or int(match.group("index")) >= len(origins):
        return param
    origin = origins[int(match.group("index"))]
    if origin in ("instructions", "input"):
        return origin
    return origin + match.group("rest").replace(".image_url.url", ".image_url")


# ---- rendering -------------------------------------------------------------------------------


class _Render:
    """The response object of one request, as its parts become known."""

    def __init__(self, req: ResponsesRequest, prepared_id: str, model: str) -> None:
        hex_id = prepared_id.removeprefix("chatcmpl-")
        self.id, self.message_id = f"resp_{hex_id}", f"msg_{hex_id}"
        self.req, self.model, self.created = req, model, int(time.time())

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 instructions: bool = True) -> dict[str, Any]:
        """The ``response`` object; ``instructions`` False: ``"instructions": null`` (a stream's early events)."""
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions if instructions else None,
            "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": False, "previous_response_id": None, "reasoning": None,
            "store": False, "temperature": req.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": [], "top_p": req.top_p, "truncation": "disabled",
            "metadata": req.metadata or {}, "usage": usage,
        }


def _status(complete: EngineEvent) -> str:
    """``completed``, or ``incomplete`` when the token limit cut the answer.

    Raises:
        GatewayError(ENGINE_ERROR): the engine finished the request with an error.
    """
    if complete.finish_reason == "error":
        raise GatewayError(ErrorCode.ENGINE_ERROR, "engine reported an error finishing the request")
    return "incomplete" if complete.finish_reason == "length" else "completed"


def _usage(answer: EngineAnswer, complete: EngineEvent, output_tokens: int) -> dict[str, Any]:
    """openai-python ``ResponseUsage``; input tokens as the chat endpoint's ``prompt_tokens``."""
    input_tokens = int(complete.prompt_tokens) or len(answer.prepared.input_ids)
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


async def _text_steps(answer: EngineAnswer, text: ChoiceText,
                      ) -> AsyncIterator[tuple[str, EngineEvent | None]]:
    """``(text delta, None)`` per engine chunk, then ``(last delta, the complete event)``; the text is
    detokenized as the chat endpoint's (:class:`mmgate.api.choice_text.ChoiceText`).

    Raises:
        GatewayError(ENGINE_ERROR): the engine's stream ended without a completion.
    """
    event: EngineEvent | None = answer.first
    while event is not None:
        if not event.is_complete:
            yield text.add(event.token_ids), None
        else:
            delta = text.add(event.token_ids) if text.tokens == 0 else ""  # not streamed: ids here
            yield delta + text.finish(event), event
            return
        event = await anext(answer.rest, None)
    raise GatewayError(ErrorCode.ENGINE_ERROR, "engine stream ended without a completion")


async def response_body(req: ResponsesRequest, answer: EngineAnswer, tokenizer: BundleTokenizer) -> dict[str, Any]:
    """The ``response`` object of a non-streamed request (the engine's stream read to its end).

    Raises:
        GatewayError(ENGINE_ERROR): the engine failed or its stream ended without a completion.
    """
    render = _Render(req, answer.prepared.request_id, answer.prepared.model)
    text = ChoiceText(tokenizer, answer.prepared.sampling)
    async for _, complete in _text_steps(answer, text):
        if complete is not None:
            status = _status(complete)
            metrics.COMPLETION_TOKENS.labels(answer.prepared.model).inc(text.tokens)
            message = render.message(text.text, status)
            return render.response(status, [message], _usage(answer, complete, text.tokens))
    raise GatewayError(ErrorCode.ENGINE_ERROR, "engine stream ended without a completion")


def _sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def response_events(req: ResponsesRequest, answer: EngineAnswer, tokenizer: BundleTokenizer,
                          release: Callable[[], None]) -> AsyncIterator[bytes]:
    """The Responses SSE sequence: ``response.created``, ``response.in_progress``,
    ``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
    (one per engine chunk that yields text), ``response.output_text.done``,
    ``response.content_part.done``, ``response.output_item.done``, then ``response.completed`` (or
    ``response.incomplete``); each event has ``type`` and a ``sequence_number`` counting from 0.
    An engine failure mid-stream becomes an ``error`` event followed by ``response.failed``.
    ``instructions`` is echoed once, in the last event (``response.completed``, ``response.incomplete`` or
    ``response.failed``); ``metadata`` (bounded) in every ``response``.  ``release`` runs once, when the
    stream ends or is abandoned."""
    render = _Render(req, answer.prepared.request_id, answer.prepared.model)
    seq = iter(range(1 << 62))
    where = {"item_id": render.message_id, "output_index": 0, "content_index": 0}

    def event(kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(seq), **fields})

    text = ChoiceText(tokenizer, answer.prepared.sampling)
    try:
        early = render.response("in_progress", [], None, instructions=False)
        yield event("response.created", response=early)
        yield event("response.in_progress", response=early)
        yield event("response.output_item.added", output_index=0, item=render.message(None, "in_progress"))
        yield event("response.content_part.added", **where, part=render.part(""))
        async for delta, complete in _text_steps(answer, text):
            if delta:
                yield event("response.output_text.delta", **where, delta=delta, logprobs=[])
            if complete is None:
                continue
            status = _status(complete)
            yield event("response.output_text.done", **where, text=text.text, logprobs=[])
            yield event("response.content_part.done", **where, part=render.part(text.text))
            message = render.message(text.text, status)
            yield event("response.output_item.done", output_index=0, item=message)
            metrics.COMPLETION_TOKENS.labels(answer.prepared.model).inc(text.tokens)
            final = render.response(status, [message], _usage(answer, complete, text.tokens))
            yield event("response.completed" if status == "completed" else "response.incomplete", response=final)
    except GatewayError as exc:
        metrics.ERRORS.labels(exc.code.value).inc()
        yield event("error", code=exc.code.value, message=exc.message, param=exc.param)
        failed = render.response("failed", [], None)
        failed["error"] = {"code": "server_error", "message": exc.message}
        yield event("response.failed", response=failed)
    finally:
        release()
        await answer.rest.aclose()


# ---- the route -------------------------------------------------------------------------------


async def answer_responses(state: ServedModel, req: ResponsesRequest) -> Response:
    """Translate, run and render one Responses request (pipeline errors renamed to Responses fields).

    Raises:
        GatewayError: any refusal of the pipeline, the worker selection or the engine, its ``param``
            renamed by :func:`responses_param`.
    """
    chat, origins = to_chat_request(req)
    try:
        answer = await start_chat(state, chat)
    except GatewayError as exc:
        renamed = responses_param(exc.param, origins)
        if renamed == exc.param:
            raise
        raise GatewayError(exc.code, exc.message, renamed) from None
    tokenizer = state.runtime.tokenizer
    if req.stream:
        events = response_events(req, answer, tokenizer, answer.release)
        return EngineStreamingResponse(events, answer.release, answer.rest, answer.headers)
    try:
        body = await response_body(req, answer, tokenizer)
    finally:
        answer.release()
        await answer.rest.aclose()
    return JSONResponse(body, headers=answer.headers)


def register_responses(app: FastAPI, state: GatewayState, body_limit: int) -> None:
    """Add ``POST /v1/responses`` to ``app`` (body read within ``state.settings.http``'s deadlines and
    ``body_limit`` bytes, as the chat endpoint's; the work cancelled when the client leaves)."""
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        async with request_body(state, request, body_limit) as body:
            req = await parse_off_loop(state, parse_responses_request, body.data)
            served = state.model_for(req.model)
            metrics.REQUESTS.labels(served.name, str(req.stream).lower()).inc()
            return body.answer(await until_disconnect(request, answer_responses(served, req)))

