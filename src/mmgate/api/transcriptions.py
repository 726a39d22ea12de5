"""OpenAI audio transcriptions: ``POST /v1/audio/transcriptions`` over the chat pipeline.

Stage: api.  In: a ``multipart/form-data`` body (OpenAI's ``audio.transcriptions.create``): ``file`` (the clip),
``model``, and optionally ``language``, ``prompt``, ``response_format`` (``json`` | ``text`` | ``verbose_json``),
``temperature``, ``stream``, plus vLLM's ``max_completion_tokens``; out: ``{"text", "usage"}``, the bare text,
a verbose object, or SSE ``transcript.text.delta`` / ``transcript.text.done`` events (openai-python
``TranscriptionStreamEvent``), ending with ``data: [DONE]`` as the gateway's other streams.

How: the served model's family writes the conversation of a transcription request
(:class:`mmgate.models.family.Transcriber`; Qwen3-ASR: transformers 5.24
``Qwen3ASRProcessor.apply_transcription_request``), which runs as a chat request with
``continue_final_message`` (the clip as an ``input_audio`` part), so intake limits, decoding, features,
routing and the engine call are the chat path's; the generated text is read back by the family (the
``language X<asr_text>`` prefix removed, as vLLM's Qwen3-ASR ``post_process_output`` and its streaming
post-processor do).

Bounds: the body is refused unread past ``--audio-max-input-bytes`` plus :data:`FORM_OVERHEAD` bytes, or
``--max-request-body-bytes`` when set (declared ``Content-Length``; else while it streams), a body that is not ``multipart/form-data`` with 415
before any byte is read; the form is parsed by Starlette's ``MultiPartParser`` (python-multipart) with one
file at most, :data:`MAX_FIELDS` fields of :data:`MAX_FIELD_BYTES` bytes at most; the file itself is bounded
by ``--audio-max-input-bytes`` (413 ``media_too_large``).  Keys: ``/v1`` paths, :mod:`mmgate.api.keys`.
Errors: the one table; a caller's audio fault names ``file``.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from mmgate.observe import metrics
from mmgate.api.answer import start_chat
from mmgate.api.choice_text import ChoiceText
from mmgate.api.disconnect import until_disconnect
from mmgate.api.http import request_body
from mmgate.api.responses import EngineStreamingResponse
from mmgate.engines.base import EngineEvent
from mmgate.errors import ErrorCode, GatewayError
from mmgate.models.family import Transcriber
from mmgate.request.parse import parse_chat_request
from mmgate.request.protocol import AUDIO_FORMATS
from mmgate.types import Modality

if TYPE_CHECKING:
    from mmgate.gateway.state import GatewayState, ServedModel
    from mmgate.routing.dispatch import EngineAnswer

PATH = "/v1/audio/transcriptions"
#: most form fields (the file not counted) and the largest one, in bytes
MAX_FIELDS = 16
MAX_FIELD_BYTES = 64 * 1024
#: bytes a body may hold beyond the file: every field at its bound plus the part headers
FORM_OVERHEAD = MAX_FIELDS * (MAX_FIELD_BYTES + 1024) + 64 * 1024
RESPONSE_FORMATS = ("json", "text", "verbose_json")
#: OpenAI's ``temperature`` range for transcriptions
TEMPERATURE_RANGE = (0.0, 1.0)
_FIELDS = frozenset({"file", "model", "language", "prompt", "response_format", "temperature", "stream",
                     "max_completion_tokens"})


@dataclass(frozen=True, slots=True)
class TranscriptionForm:
    """The fields of one transcription request, checked."""

    data: bytes  # the clip's bytes
    format: str  # the container its file name says (a label for the part; the decoder sniffs the bytes)
    model: str
    language: str | None
    prompt: str | None
    response_format: str
    temperature: float | None
    stream: bool
    max_completion_tokens: int | None


def require_multipart(request: Request) -> None:
    """Refuse a body that is not ``multipart/form-data`` (415) before reading it."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "multipart/form-data":
        raise GatewayError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, "the request body must be multipart/form-data")


async def parse_form(request: Request, data: bytes) -> FormData:
    """The form of ``data`` (the whole body), one file and :data:`MAX_FIELDS` small fields at most.

    Raises:
        GatewayError(INVALID_REQUEST): malformed, more files or fields than allowed, a field too large.
    """
    async def body() -> AsyncGenerator[bytes, None]:
        yield data

    parser = MultiPartParser(request.headers, body(), max_files=1, max_fields=MAX_FIELDS,
                             max_part_size=MAX_FIELD_BYTES)
    try:
        return await parser.parse()
    except MultiPartException as exc:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"invalid multipart form: {exc.message}") from None


def _text(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"{name} must be a form field, not a file", name)
    return value


def _number(value: str | None, name: str, kind: type) -> Any:
    if value is None or value == "":
        return None
    try:
        number = kind(value)
    except ValueError:
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"{name} must be a number", name) from None
    if isinstance(number, float) and not math.isfinite(number):
        raise GatewayError(ErrorCode.INVALID_REQUEST, f"{name} must be finite", name)
    return number


async def read_form(form: FormData, max_file_bytes: int) -> TranscriptionForm:
    """The checked fields of ``form``.

    Raises:
        GatewayError(INVALID_REQUEST): a field OpenAI's shape does not have here, ``file`` or ``model`` missing,
            a value outside its range.
        GatewayError(MEDIA_TOO_LARGE): the file is larger than ``max_file_bytes``.
    """
    for key in form.keys():
        if key not in _FIELDS:
            raise GatewayError(ErrorCode.INVALID_REQUEST, "unknown or unsupported form field (taken: "
                               + ", ".join(sorted(_FIELDS)) + ")", key if len(key) <= 64 else None)
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise GatewayError(ErrorCode.INVALID_REQUEST, "file is required (the audio to transcribe, as a file part)",
                           "file")
    if upload.size is not None and upload.size > max_file_bytes:
        raise GatewayError(ErrorCode.MEDIA_TOO_LARGE, f"file exceeds {max_file_bytes} bytes", "file")
    data = await upload.read()
    if len(data) > max_file_bytes:
        raise GatewayError(ErrorCode.MEDIA_TOO_LARGE, f"file exceeds {max_file_bytes} bytes", "file")
    if not data:
        raise GatewayError(ErrorCode.AUDIO_EMPTY, "file is empty", "file")
    model = _text(form, "model")
    if not model:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "model is required", "model")
    response_format = _text(form, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "response_format must be one of " + ", ".join(RESPONSE_FORMATS),
                           "response_format")
    temperature = _number(_text(form, "temperature"), "temperature", float)
    if temperature is not None and not TEMPERATURE_RANGE[0] <= temperature <= TEMPERATURE_RANGE[1]:
        raise GatewayError(ErrorCode.INVALID_REQUEST, "temperature must be between 0 and 1", "temperature")
    max_tokens = _number(_text(form, "max_completion_tokens"), "max_completion_tokens", int)
    stream_text = (_text(form, "stream") or "false").strip().lower()
    if stream_text not in ("true", "false"):
        raise GatewayError(ErrorCode.INVALID_REQUEST, "stream must be true or false", "stream")
    suffix = (upload.filename or "").rpartition(".")[2].lower()
    language = _text(form, "language") or None
    return TranscriptionForm(data=data, format=suffix if suffix in AUDIO_FORMATS else "wav", model=model,
                             language=language, prompt=_text(form, "prompt"), response_format=response_format,
                             temperature=temperature, stream=stream_text == "true", max_completion_tokens=max_tokens)


def transcriber_of(served: ServedModel) -> Transcriber:
    """The served model's family as a :class:`Transcriber`.

    Raises:
        GatewayError(MULTIMODAL_NOT_SUPPORTED): the model takes no audio, or has no transcription prompt (400).
    """
    family = served.runtime.family
    if family is None or Modality.AUDIO not in family.processors:
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, "the model takes no audio input", "model")
    if not isinstance(family, Transcriber):
        raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, "the model has no transcription prompt", "model")
    return family


def chat_body(form: TranscriptionForm, messages: list[dict[str, Any]]) -> bytes:
    """The chat request a transcription runs as (its ``messages``; the last message continued)."""
    body: dict[str, Any] = {"model": form.model, "messages": messages, "add_generation_prompt": False,
                            "continue_final_message": True, "stream": form.stream}
    if form.temperature is not None:
        body["temperature"] = form.temperature
    if form.max_completion_tokens is not None:
        body["max_completion_tokens"] = form.max_completion_tokens
    return json.dumps(body).encode()


def _as_form_error(exc: GatewayError, messages: list[dict[str, Any]]) -> GatewayError:
    """A refusal the chat path names ``messages[...]`` renamed to the form's field: the user message (the clip)
    is ``file``, the others (the system prompt, the prefill) ``prompt``."""
    if not exc.param or not exc.param.startswith("messages"):
        return exc
    user = next(i for i, m in enumerate(messages) if m.get("role") == "user")
    field = "file" if exc.param.startswith(f"messages[{user}]") else "prompt"
    return GatewayError(exc.code, exc.message, field)


def _usage(answer: EngineAnswer, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    audio = sum(p.num_tokens for p in answer.prepared.plans)
    return {"type": "tokens", "input_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
            "input_token_details": {"audio_tokens": audio, "text_tokens": max(prompt_tokens - audio, 0)}}


async def _whole(answer: EngineAnswer, served: ServedModel) -> tuple[str, int, int]:
    """The generated text, the prompt's token count and the generated tokens' (one choice)."""
    text = ChoiceText(served.runtime.tokenizer, answer.prepared.sampling)
    event: EngineEvent | None = answer.first
    while event is not None:
        if event.is_complete:
            if text.tokens == 0:
                text.add(event.token_ids)
            text.finish(event)
            if event.finish_reason == "error":
                raise GatewayError(ErrorCode.ENGINE_ERROR, "engine reported an error finishing the request")
            prompt = int(event.prompt_tokens) or len(answer.prepared.input_ids)
            return text.text, prompt, text.tokens
        text.add(event.token_ids)
        event = await anext(answer.rest, None)
    raise GatewayError(ErrorCode.ENGINE_ERROR, "engine stream ended without a completion")


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _stream(answer: EngineAnswer, served: ServedModel, transcriber: Transcriber) -> AsyncIterator[bytes]:
    """``transcript.text.delta`` events, then ``transcript.text.done`` with the text and ``usage``; an engine
    failure mid-stream becomes an ``error`` event."""
    text = ChoiceText(served.runtime.tokenizer, answer.prepared.sampling)
    reader = transcriber.transcript_stream()
    sent: list[str] = []
    try:
        event: EngineEvent | None = answer.first
        while event is not None:
            piece = text.add(event.token_ids) if not event.is_complete or text.tokens == 0 else ""
            if event.is_complete:
                piece += text.finish(event)
                if event.finish_reason == "error":
                    raise GatewayError(ErrorCode.ENGINE_ERROR, "engine reported an error finishing the request")
            delta = reader.feed(piece, event.is_complete)
            if delta:
                sent.append(delta)
                yield _sse({"type": "transcript.text.delta", "delta": delta})
            if event.is_complete:
                prompt = int(event.prompt_tokens) or len(answer.prepared.input_ids)
                metrics.COMPLETION_TOKENS.labels(answer.prepared.model).inc(text.tokens)
                yield _sse({"type": "transcript.text.done", "text": "".join(sent),
                            "usage": _usage(answer, prompt, text.tokens)})
                break
            event = await anext(answer.rest, None)
        else:
            raise GatewayError(ErrorCode.ENGINE_ERROR, "engine stream ended without a completion")
    except GatewayError as exc:
        metrics.ERRORS.labels(exc.code.value).inc()
        yield _sse(exc.body())
    finally:
        answer.release()
        await answer.rest.aclose()
    yield b"data: [DONE]\n\n"


async def answer_transcription(served: ServedModel, form: TranscriptionForm) -> Response:
    """Run the transcription on ``served`` and render it in ``form.response_format``."""
    transcriber = transcriber_of(served)
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(form.data).decode("ascii"),
                                                   "format": form.format}}
    messages = transcriber.transcription_messages(part, form.language, form.prompt)
    try:
        answer = await start_chat(served, parse_chat_request(chat_body(form, messages)))
    except GatewayError as exc:
        raise _as_form_error(exc, messages) from None
    if form.stream:
        return EngineStreamingResponse(_stream(answer, served, transcriber), answer.release, answer.rest,
                                       answer.headers)
    try:
        generated, prompt_tokens, output_tokens = await _whole(answer, served)
    finally:
        answer.release()
        await answer.rest.aclose()
    metrics.COMPLETION_TOKENS.labels(answer.prepared.model).inc(output_tokens)
    detected, text = transcriber.transcript(generated)
    if form.response_format == "text":
        return PlainTextResponse(text, headers=answer.headers)
    if form.response_format == "verbose_json":
        seconds = sum(transcriber.clip_seconds(p) for p in answer.prepared.plans)
        forced = transcriber.language_name(form.language) if form.language is not None else None
        language = forced or detected or ""
        body: dict[str, Any] = {"task": "transcribe", "language": language.lower(), "duration": seconds,
                                "text": text, "segments": [], "usage": {"type": "duration", "seconds": seconds}}
        return JSONResponse(body, headers=answer.headers)
    return JSONResponse({"text": text, "usage": _usage(answer, prompt_tokens, output_tokens)},
                        headers=answer.headers)


def register_transcriptions(app: FastAPI, state: GatewayState) -> None:
    """Add ``POST /v1/audio/transcriptions`` to ``app``."""
    max_file = state.settings.fetch.audio_max_bytes
    limit = state.settings.max_request_body_bytes or max_file + FORM_OVERHEAD  # --max-request-body-bytes wins

    @app.post(PATH)
    async def transcriptions(request: Request) -> Response:
        async with request_body(state, request, limit, require_multipart) as body:
            form = await read_form(await parse_form(request, body.data), max_file)
            served = state.model_for(form.model)
            metrics.REQUESTS.labels(served.name, str(form.stream).lower()).inc()
            return body.answer(await until_disconnect(request, answer_transcription(served, form)))
