"""OpenAI chat-completion response bodies, streamed (SSE) and whole.

In: the prepared request, the engine's answer as neutral events
(:class:`~mmgate.engines.base.EngineEvent`, whatever the wire; the first one
already received, so engine refusals surface as HTTP errors before any byte of
the stream is sent); out: ``chat.completion`` JSON or
``chat.completion.chunk`` SSE events ending with ``data: [DONE]``.

``usage.prompt_tokens`` is the engine's own count (the ``complete`` event's ``prompt_tokens``,
taken after expansion), else the length of the expanded ``input_ids``: with
worker-side media processing only the engine knows the expanded length.
Streaming text is detokenized incrementally with ``tokenizers``'
``DecodeStream`` (no re-decoding of the whole output per token), stop strings,
stop tokens and logprobs as vLLM's detokenizer and chat server treat them
(:mod:`mmgate.api.choice_text`).  ``n`` choices: the engine's events carry
each choice's ``index``; the answer is complete once every choice has its
``complete`` event; ``usage.completion_tokens`` sums the choices.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from mmgate.observe import metrics
from mmgate.api.choice_text import ChoiceText
from mmgate.api.output_parsing import PLAIN, OutputParsing
from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.engines.base import EngineEvent
from mmgate.errors import ErrorCode, GatewayError
from mmgate.request.structured import ToolMode
from mmgate.types import PreparedRequest

_FINISH = {"stop": "stop", "length": "length", "": "stop"}  # an engine abort never gets here (WorkerClient.generate)


def _finish_reason(complete: EngineEvent) -> str:
    reason = complete.finish_reason
    if reason == "error":
        raise GatewayError(ErrorCode.ENGINE_ERROR, "engine reported an error finishing the request")
    return _FINISH.get(reason, reason)


def _prompt_tokens(prepared: PreparedRequest, complete: EngineEvent) -> int:
    """The engine's count of the expanded prompt; our own when the engine reports none."""
    return int(complete.prompt_tokens) or len(prepared.input_ids)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _choice_count(prepared: PreparedRequest) -> int:
    return max(prepared.sampling.n, 1)


async def _events(first: EngineEvent, rest: AsyncIterator[EngineEvent], n: int) -> AsyncIterator[EngineEvent]:
    """The engine's events until every one of the ``n`` choices has its ``complete`` event.

    Raises:
        GatewayError(ENGINE_ERROR): the stream ended first.
    """
    done: set[int] = set()
    event: EngineEvent | None = first
    while event is not None:
        yield event
        if event.is_complete:
            done.add(event.index)
            if len(done) >= n:
                return
        event = await anext(rest, None)
    raise GatewayError(ErrorCode.ENGINE_ERROR, "engine stream ended without a completion")


async def completion_body(prepared: PreparedRequest, first: EngineEvent, rest: AsyncIterator[EngineEvent],
                          tokenizer: BundleTokenizer, parsing: OutputParsing = PLAIN) -> dict[str, Any]:
    """The ``chat.completion`` object of a non-streamed request: ``n`` choices, ``usage`` summed over
    them (vLLM ``OpenAIServingChat.chat_completion_full_generator``).  ``parsing``: reasoning and
    tool-call parsing of each choice's text (:mod:`mmgate.api.output_parsing`)."""
    n = _choice_count(prepared)
    texts = [ChoiceText(tokenizer, prepared.sampling) for _ in range(n)]
    completes: dict[int, EngineEvent] = {}
    async for event in _events(first, rest, n):
        choice = texts[_index(event.index, n)]
        if not event.is_complete:
            choice.add(event.token_ids, event.logprobs)
            continue
        if choice.tokens == 0:  # not streamed: the ids and logprobs are on the completion
            choice.add(event.token_ids, event.logprobs)
        choice.finish(event)
        completes[event.index] = event
    completion_tokens = sum(t.tokens for t in texts)
    metrics.COMPLETION_TOKENS.labels(prepared.model).inc(completion_tokens)
    choices = []
    for i in range(n):
        message, called = parsing.message(texts[i].text, prepared.prompt_text)  # H-C2: reasoning, tool calls
        choices.append({"index": i, "message": message, "logprobs": texts[i].take_logprobs(),
                        "finish_reason": _tool_finish(_finish_reason(completes[i]), called, parsing)})
    any_complete = next(iter(completes.values()))
    return {
        "id": prepared.request_id, "object": "chat.completion", "created": int(time.time()), "model": prepared.model,
        "choices": choices, "usage": _usage(_prompt_tokens(prepared, any_complete), completion_tokens),
    }


def _tool_finish(finish: str, called: bool, parsing: OutputParsing) -> str:
    """``tool_calls`` for a choice that called tools and stopped on its own (a cut-off one stays
    ``length``), with ``tool_choice`` auto or required; a named function forced by ``tool_choice``
    finishes ``stop``, as vLLM (``is_finish_reason_tool_calls``) and OpenAI report it."""
    if parsing.tools.mode is ToolMode.NAMED:
        return finish
    return "tool_calls" if called and finish == "stop" else finish


def _index(index: int, n: int) -> int:
    if not 0 <= index < n:
        raise GatewayError(ErrorCode.ENGINE_ERROR, "engine answered with a choice index outside n")
    return index


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def sse_stream(prepared: PreparedRequest, first: EngineEvent,
                     rest: AsyncIterator[EngineEvent], tokenizer: BundleTokenizer,
                     include_usage: bool, release: Callable[[], None],
                     parsing: OutputParsing = PLAIN) -> AsyncIterator[bytes]:
    """``chat.completion.chunk`` events; an engine failure mid-stream becomes an ``error`` event.

    As vLLM ``OpenAIServingChat.chat_completion_stream_generator``: a role chunk per choice first,
    then content chunks carrying their choice's ``index`` (and ``logprobs`` when asked for), a
    finish chunk per choice when its engine ``complete`` event arrives, and with
    ``include_usage`` a last chunk with ``usage`` summed over the choices.
    """
    created = int(time.time())
    base = {"id": prepared.request_id, "object": "chat.completion.chunk", "created": created, "model": prepared.model}
    n = _choice_count(prepared)
    texts = [ChoiceText(tokenizer, prepared.sampling) for _ in range(n)]
    outputs = [parsing.stream(prepared.prompt_text) for _ in range(n)]  # H-C2: reasoning, tool-call deltas
    prompt_tokens = len(prepared.input_ids)

    def chunk(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish: str | None) -> bytes:
        return _event({**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                            "finish_reason": finish}]})

    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""}, None, None)
        async for event in _events(first, rest, n):
            i = _index(event.index, n)
            choice = texts[i]
            if not event.is_complete:
                piece = choice.add(event.token_ids, event.logprobs)
            else:
                piece = choice.add(event.token_ids, event.logprobs) if choice.tokens == 0 else ""
                piece += choice.finish(event)
            logprobs = choice.take_logprobs()
            delta = outputs[i].feed(piece) if piece else {}
            if delta or (logprobs is not None and logprobs["content"]):
                yield chunk(i, delta or {"content": ""}, logprobs, None)
            if event.is_complete:
                prompt_tokens = _prompt_tokens(prepared, event)
                if held := outputs[i].flush():
                    yield chunk(i, held, None, None)
                yield chunk(i, {}, None, _tool_finish(_finish_reason(event), outputs[i].called, parsing))
        count = sum(t.tokens for t in texts)
        if include_usage:
            yield _event({**base, "choices": [], "usage": _usage(prompt_tokens, count)})
        metrics.COMPLETION_TOKENS.labels(prepared.model).inc(count)
    except GatewayError as exc:
        metrics.ERRORS.labels(exc.code.value).inc()
        yield _event(exc.body())
    finally:
        release()
        await rest.aclose()  # type: ignore[attr-defined]
    yield b"data: [DONE]\n\n"


class EngineStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` over an engine answer that always closes it.

    The body generator's ``finally`` releases the worker slot and closes the engine stream, but a
    generator that never started (the client left between the handler's return and the first chunk)
    never runs it: this response closes the body and the engine stream and calls ``release`` when it
    ends, however it ends (``release`` and ``aclose`` are idempotent), then every release handed to
    :meth:`release_after` (the request body's hold on the idle trimmer, :class:`mmgate.api.http.RequestBody`).
    """

    def __init__(self, body: AsyncIterator[bytes], release: Callable[[], None],
                 rest: AsyncGenerator[Any, None], headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._body = body
        self._release = release
        self._rest = rest
        self._after: list[Callable[[], None]] = []

    def release_after(self, release: Callable[[], None]) -> None:
        """Call ``release`` once this stream has ended (after the engine stream is closed)."""
        self._after.append(release)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                close = getattr(self._body, "aclose", None)
                if close is not None:
                    await close()
                await self._rest.aclose()
            finally:
                try:
                    self._release()
                finally:
                    for release in self._after:
                        release()


async def respond(prepared: PreparedRequest, stream: bool, include_usage: bool,
                  first: EngineEvent, rest: AsyncGenerator[EngineEvent, None],
                  tokenizer: BundleTokenizer, release: Callable[[], None], headers: dict[str, str],
                  parsing: OutputParsing = PLAIN) -> Response:
    """The HTTP response of a request whose engine has answered once: SSE or one JSON body.

    ``release`` runs exactly once, when the stream or the body is finished (or failed).  ``parsing``:
    how the text becomes ``reasoning_content`` / ``content`` / ``tool_calls`` (:mod:`mmgate.api.output_parsing`).
    """
    if stream:
        body = sse_stream(prepared, first, rest, tokenizer, include_usage, release, parsing)
        return EngineStreamingResponse(body, release, rest, headers)
    try:
        body_json = await completion_body(prepared, first, rest, tokenizer, parsing)
    finally:
        release()
        await rest.aclose()
    return JSONResponse(body_json, headers=headers)
