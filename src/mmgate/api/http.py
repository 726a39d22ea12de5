"""HTTP helpers every endpoint shares: request bodies, the rendering of an error, the framework's refusals.

Stage: api (before and after the pipeline).  In: a Starlette request; out: its JSON body (read within the
gateway's deadlines and byte limit, held by the idle trimmer while the request runs), or an error rendered
from the one table (:mod:`mmgate.errors`): body ``{"error": {...}}`` plus ``X-SMG-Error-Code`` and, for a
retryable code, ``Retry-After``.  No endpoint lives here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from mmgate.observe import metrics
from mmgate.api.responses import EngineStreamingResponse
from mmgate.errors import ErrorCode, GatewayError
from mmgate.config.settings import HttpSettings, Settings

if TYPE_CHECKING:
    from mmgate.gateway.state import GatewayState

log = logging.getLogger("mmgate.api")
T = TypeVar("T")


def error_response(exc: GatewayError) -> JSONResponse:
    """The one rendering of an error (body + header + Retry-After for retryable codes)."""
    metrics.ERRORS.labels(exc.code.value).inc()
    headers = {"X-SMG-Error-Code": exc.code.value}
    if exc.spec.retryable:
        headers["Retry-After"] = "2" if exc.code is ErrorCode.MULTIMODAL_INFLIGHT_BUDGET else "1"
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


#: refusals the framework raises itself (Starlette's router: 404 no route, 405 wrong method; FastAPI's request
#: validation, 422, answered 400 as vLLM's ``api_server`` does) by status -> codes of the one table
FRAMEWORK_CODES: dict[int, ErrorCode] = {
    400: ErrorCode.INVALID_REQUEST, 404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.REQUEST_TOO_LARGE, 415: ErrorCode.UNSUPPORTED_MEDIA_TYPE, 422: ErrorCode.INVALID_REQUEST,
}
_FRAMEWORK_MESSAGES = {ErrorCode.NOT_FOUND: "no route for this path",
                       ErrorCode.METHOD_NOT_ALLOWED: "method not allowed on this path",
                       ErrorCode.REQUEST_TOO_LARGE: "request body too large",
                       ErrorCode.UNSUPPORTED_MEDIA_TYPE: "unsupported content type",
                       ErrorCode.INTERNAL_ERROR: "internal error"}


def framework_error(status: int, allow: str | None = None) -> GatewayError:
    """The error of the table for a refusal of status ``status`` raised by the framework (another 4xx:
    ``invalid_request``, another 5xx: ``internal_error``); ``allow``: a 405's ``Allow`` header, named in
    the message.  Never quotes the caller's path or method."""
    code = FRAMEWORK_CODES.get(status, ErrorCode.INVALID_REQUEST if status < 500 else ErrorCode.INTERNAL_ERROR)
    message = _FRAMEWORK_MESSAGES.get(code, "invalid request")
    if code is ErrorCode.METHOD_NOT_ALLOWED and allow:
        message += f" (allowed: {allow})"
    return GatewayError(code, message)


def require_json(request: Request) -> None:
    """Refuse a body that is not ``Content-Type: application/json`` (parameters such as ``charset`` allowed).

    A missing, ``text/plain`` or form-encoded type is what a browser may post cross-site without a CORS
    preflight, so it is refused before any byte of the body is read.

    Raises:
        GatewayError(UNSUPPORTED_MEDIA_TYPE): 415.
    """
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise GatewayError(ErrorCode.UNSUPPORTED_MEDIA_TYPE, "the request body must be Content-Type: application/json")


async def read_body(request: Request, limit: int, http: HttpSettings = HttpSettings(),
                    require: Callable[[Request], None] = require_json) -> bytes:
    """The JSON request body (:func:`require_json` first; another content-type check with ``require``), read
    within ``http``'s deadlines.

    Each wait for the next chunk is bounded by ``http.body_idle_timeout_s`` and the whole body by
    ``http.body_timeout_s`` (from the first read); the response to a refusal here closes the
    connection (``mmgate.api.server.CloseUnreadBody``).

    Raises:
        GatewayError(UNSUPPORTED_MEDIA_TYPE): 415, not JSON.
        GatewayError(REQUEST_TOO_LARGE): 413, past ``limit`` bytes (declared or streamed).
        GatewayError(REQUEST_TIMEOUT): 408, the body stalled or took too long.
        GatewayError(CLIENT_DISCONNECTED): the client left mid-upload (logged at INFO; no answer reaches it).
    """
    require(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise GatewayError(ErrorCode.REQUEST_TOO_LARGE, f"request body exceeds {limit} bytes")
    chunks = bytearray()
    stream = request.stream()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + http.body_timeout_s
    try:
        while True:
            left = deadline - loop.time()
            try:
                async with asyncio.timeout(max(0.0, min(http.body_idle_timeout_s, left))):
                    chunk = await anext(stream)
            except StopAsyncIteration:
                break
            except TimeoutError:
                limit_s = http.body_timeout_s if left <= http.body_idle_timeout_s else http.body_idle_timeout_s
                raise GatewayError(ErrorCode.REQUEST_TIMEOUT,
                                   f"request body not received within {limit_s:g} s") from None
            chunks += chunk
            if len(chunks) > limit:
                raise GatewayError(ErrorCode.REQUEST_TOO_LARGE, f"request body exceeds {limit} bytes")
    except ClientDisconnect:
        metrics.CLIENT_DISCONNECTS.inc()
        log.info("client disconnected while sending its request body")
        raise GatewayError(ErrorCode.CLIENT_DISCONNECTED, "client disconnected") from None
    return bytes(chunks)


#: bodies larger than this are parsed in the pool (depth scan + decode of a large body take seconds)
_PARSE_ON_LOOP_BYTES = 1 << 20


async def parse_off_loop(state: GatewayState, parse: Callable[[bytes], T], body: bytes) -> T:
    """``parse(body)``: on the event loop for a small body, in the preprocessing pool for a large one."""
    if len(body) <= _PARSE_ON_LOOP_BYTES:
        return parse(body)
    return await asyncio.get_running_loop().run_in_executor(state.executor, parse, body)


@dataclass(slots=True)
class RequestBody:
    """A request's body and its hold on the idle trimmer (:meth:`mmgate.pipeline.memory.IdleTrimmer.hold`).

    The hold ends when the request is done: when its handler returns, or, for a streamed answer handed to
    :meth:`answer`, when the stream ends, however it ends (finished, failed, the client gone): the parsed
    request and the prepared tensors live as long as the stream, so a trim before its end returns nothing
    and none would come after it.
    """

    data: bytes
    release: Callable[[], None] | None  # the trimmer's release while this body holds it

    def answer(self, response: Response) -> Response:
        """``response``; a streamed one takes the hold over and releases it once its stream has ended."""
        if self.release is not None and isinstance(response, EngineStreamingResponse):
            response.release_after(self.release)
            self.release = None
        return response

    def done(self) -> None:
        """Release the hold unless a streamed answer took it over (idempotent)."""
        release, self.release = self.release, None
        if release is not None:
            release()


@asynccontextmanager
async def request_body(state: GatewayState, request: Request, limit: int,
                       require: Callable[[Request], None] = require_json) -> AsyncIterator[RequestBody]:
    """The request's body (:func:`read_body` within ``state.settings.http``'s deadlines), held by the idle
    trimmer while the request runs: a large body (a huge prompt) leaves freed heap behind that the
    trimmer returns once the gateway is idle.  Every POST endpoint reads its body through this and hands
    its response to :meth:`RequestBody.answer`, so a streamed answer keeps the hold to its end."""
    data = await read_body(request, limit, state.settings.http, require)
    trimmer = state.budget.trimmer
    body = RequestBody(data, trimmer.hold(len(data)) if trimmer is not None else None)
    try:
        yield body
    finally:
        body.done()


def body_limit_for(settings: Settings) -> int:
    """Largest accepted body: every item at its byte cap as base64 would not fit anyway, so the bound is
    the largest per-item cap in base64 (4/3) plus 1 MiB of text, unless set explicitly."""
    if settings.max_request_body_bytes:
        return settings.max_request_body_bytes
    fs = settings.fetch
    return max(fs.image_max_bytes, fs.video_max_bytes, fs.audio_max_bytes) * 4 // 3 + 1024 * 1024
