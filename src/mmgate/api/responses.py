"""OpenAI chat-completion response bodies, streamed (SSE) and whole.

In: the prepared request, the engine's ``GenerateResponse`` stream (its first
message already received, so engine refusals surface as HTTP errors before any
byte of the stream is sent); out: ``chat.completion`` JSON or
``chat.completion.chunk`` SSE events ending with ``data: [DONE]``.

``usage.prompt_tokens`` is the engine's own count (``GenerateComplete.prompt_tokens``,
taken after expansion), else the length of the expanded ``input_ids``: with
worker-side media processing only the engine knows the expanded length.
Streaming text is detokenized incrementally with ``tokenizers``'
``DecodeStream`` (no re-decoding of the whole output per token).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from smg_grpc_proto.generated import vllm_engine_pb2
from tokenizers.decoders import DecodeStream

from mmgate import metrics
from mmgate.chat.tokenizer import BundleTokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.types import PreparedRequest

_FINISH = {"stop": "stop", "length": "length", "abort": "stop", "": "stop"}


def _finish_reason(complete: vllm_engine_pb2.GenerateComplete) -> str:
    reason = complete.finish_reason
    if reason == "error":
        raise GatewayError(ErrorCode.ENGINE_ERROR, "engine reported an error finishing the request")
    return _FINISH.get(reason, reason)


def _prompt_tokens(prepared: PreparedRequest, complete: vllm_engine_pb2.GenerateComplete) -> int:
    """The engine's count of the expanded prompt; our own when the engine reports none."""
    return int(complete.prompt_tokens) or len(prepared.input_ids)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def completion_body(prepared: PreparedRequest, first: vllm_engine_pb2.GenerateResponse,
                          rest: AsyncIterator[vllm_engine_pb2.GenerateResponse],
                          tokenizer: BundleTokenizer) -> dict[str, Any]:
    """The ``chat.completion`` object of a non-streamed request."""
    streamed: list[int] = []
    complete: vllm_engine_pb2.GenerateComplete | None = None
    resp: vllm_engine_pb2.GenerateResponse | None = first
    while resp is not None:
        kind = resp.WhichOneof("response")
        if kind == "chunk":
            streamed.extend(resp.chunk.token_ids)
        elif kind == "complete":
            complete = resp.complete
            break
        resp = await anext(rest, None)
    if complete is None:
        raise GatewayError(ErrorCode.ENGINE_ERROR, "engine stream ended without a completion")
    output = streamed or list(complete.output_ids)
    metrics.COMPLETION_TOKENS.inc(len(output))
    return {
        "id": prepared.request_id, "object": "chat.completion", "created": int(time.time()), "model": prepared.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": tokenizer.decode(output)},
                     "logprobs": None, "finish_reason": _finish_reason(complete)}],
        "usage": _usage(_prompt_tokens(prepared, complete), len(output)),
    }


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def sse_stream(prepared: PreparedRequest, first: vllm_engine_pb2.GenerateResponse,
                     rest: AsyncIterator[vllm_engine_pb2.GenerateResponse], tokenizer: BundleTokenizer,
                     include_usage: bool, release: Callable[[], None]) -> AsyncIterator[bytes]:
    """``chat.completion.chunk`` events; an engine failure mid-stream becomes an ``error`` event."""
    created = int(time.time())
    base = {"id": prepared.request_id, "object": "chat.completion.chunk", "created": created, "model": prepared.model}
    decoder = DecodeStream(skip_special_tokens=True)
    count = 0
    try:
        yield _event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]})
        resp: vllm_engine_pb2.GenerateResponse | None = first
        while resp is not None:
            kind = resp.WhichOneof("response")
            if kind == "chunk" or (kind == "complete" and count == 0):
                ids = resp.chunk.token_ids if kind == "chunk" else resp.complete.output_ids
                pieces = []
                for tok in ids:
                    count += 1
                    piece = decoder.step(tokenizer.tokenizer, tok)
                    if piece:
                        pieces.append(piece)
                if pieces:
                    yield _event({**base, "choices": [{"index": 0, "delta": {"content": "".join(pieces)},
                                                       "logprobs": None, "finish_reason": None}]})
            if kind == "complete":
                finish = _finish_reason(resp.complete)
                yield _event({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}]})
                if include_usage:
                    usage = _usage(_prompt_tokens(prepared, resp.complete), count)
                    yield _event({**base, "choices": [], "usage": usage})
                break
            resp = await anext(rest, None)
        else:
            raise GatewayError(ErrorCode.ENGINE_ERROR, "engine stream ended without a completion")
        metrics.COMPLETION_TOKENS.inc(count)
    except GatewayError as exc:
        metrics.ERRORS.labels(exc.code.value).inc()
        yield _event(exc.body())
    finally:
        release()
        await rest.aclose()  # type: ignore[attr-defined]
    yield b"data: [DONE]\n\n"


async def respond(prepared: PreparedRequest, stream: bool, include_usage: bool,
                  first: vllm_engine_pb2.GenerateResponse, rest: AsyncGenerator[vllm_engine_pb2.GenerateResponse, None],
                  tokenizer: BundleTokenizer, release: Callable[[], None], headers: dict[str, str]) -> Response:
    """The HTTP response of a request whose engine has answered once: SSE or one JSON body.

    ``release`` runs exactly once, when the stream or the body is finished (or failed).
    """
    if stream:
        body = sse_stream(prepared, first, rest, tokenizer, include_usage, release)
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)
    try:
        body_json = await completion_body(prepared, first, rest, tokenizer)
    finally:
        release()
        await rest.aclose()
    return JSONResponse(body_json, headers=headers)
