"""The HTTP layer: FastAPI app factory and the gateway's state.

Routes: ``POST /v1/chat/completions`` (stream and non-stream, OpenAI shapes),
``GET /v1/models``, ``GET /health``, ``GET /workers``, ``GET /metrics``;
``POST /v1/messages`` (Anthropic shapes, errors included) from :mod:`mmgate.api.anthropic`.
All failures go through one handler that renders the error table
(:mod:`mmgate.errors`): body ``{"error": {...}}`` plus ``X-SMG-Error-Code``;
unexpected exceptions become 500 ``internal_error`` without a stack trace in
the body (it is logged).  The framework's own refusals (an unknown route, a wrong
method, FastAPI's validation) are codes of the same table (:func:`framework_error`),
in Anthropic's shape under ``/v1/messages``.  Stage timings of each request travel back in the
``X-Mmgate-Stage-Ms`` header (``stage=ms,...``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mmgate import memory, metrics
from mmgate.api.anthropic import anthropic_error_response, is_anthropic_path, register_anthropic
from mmgate.api.answer import start_chat
from mmgate.api.disconnect import until_disconnect
from mmgate.api.openai_responses import register_responses
from mmgate.api.output_parsing import output_parsing
from mmgate.request.parse import parse_chat_request
from mmgate.request.protocol import ChatCompletionRequest
from mmgate.api.responses import EngineStreamingResponse, respond
from mmgate.budget import InflightBudget
from mmgate.cache import PixelCache
from mmgate.chat.tokenizer import load_tokenizer
from mmgate.errors import ErrorCode, GatewayError
from mmgate.media.fetch import MediaFetcher
from mmgate.models.bundle import resolve_bundle
from mmgate.models.geometry import resolve_backend
from mmgate.models.registry import load_family
from mmgate.pipeline import Pipeline
from mmgate.runtime import ModelRuntime
from mmgate.routing.workers import WorkerRegistry
from mmgate.settings import HttpSettings, ImageBackend, Settings
from mmgate.transport.shm import sweep_dead_segments

log = logging.getLogger("mmgate.api")
T = TypeVar("T")


@dataclass(slots=True)
class GatewayState:
    """Everything a running gateway holds."""

    settings: Settings
    runtime: ModelRuntime
    pipeline: Pipeline
    workers: WorkerRegistry
    fetcher: MediaFetcher
    executor: ThreadPoolExecutor
    budget: InflightBudget
    started: float


def build_state(settings: Settings) -> GatewayState:
    """Load the model bundle, tokenizer and family; build fetcher, pool and worker registry.

    Raises:
        GatewayError(MODEL_NOT_FOUND): the model cannot be found or has no usable tokenizer.
    """
    bundle = resolve_bundle(settings.model, settings.model_search_path)
    tokenizer = load_tokenizer(bundle)
    backend = resolve_backend(settings.image_backend)
    family = load_family(bundle, tokenizer, backend, ImageBackend.TORCHVISION,  # video: torchvision-only reference
                         video_sampling=settings.video.frame_sampling)
    runtime = ModelRuntime(bundle=bundle, tokenizer=tokenizer, family=family,
                           served_name=settings.served_model_name or bundle.name)
    threads = settings.preprocess_threads or (os.cpu_count() or 2)
    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mmgate-pre")
    fetcher = MediaFetcher(settings.fetch)
    cache = PixelCache(settings.transport.pixel_cache_bytes) if settings.transport.pixel_cache_bytes else None
    swept = sweep_dead_segments()
    if swept:
        log.info("removed %d shared-memory segments left by dead processes", swept)
    log.info("serving %s (model_type %s, image backend %s)", runtime.served_name, bundle.model_type, backend.value)
    memory.release_startup_garbage()
    return GatewayState(settings=settings, runtime=runtime,
                        pipeline=Pipeline(runtime, settings, fetcher, executor, cache, parallelism=threads),
                        workers=WorkerRegistry.from_settings(settings), fetcher=fetcher, executor=executor,
                        budget=InflightBudget(settings.transport.max_inflight_bytes, settings.transport.budget_wait_s,
                                              memory.configure(settings.malloc_mmap_threshold,
                                                               settings.memory_trim_min_bytes,
                                                               settings.malloc_trim_threshold,
                                                               settings.malloc_arena_max)),
                        started=time.time())


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


def render_error(request: Request, exc: GatewayError, headers: dict[str, str] | None = None) -> Response:
    """:func:`error_response`, in Anthropic's shape on a ``/v1/messages`` path; ``headers`` added (a 405's
    ``Allow``)."""
    path = request.scope.get("path", "")
    response = anthropic_error_response(exc, error_response) if is_anthropic_path(path) else error_response(exc)
    response.headers.update(headers or {})
    return response


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


async def read_body(request: Request, limit: int, http: HttpSettings = HttpSettings()) -> bytes:
    """The JSON request body (:func:`require_json` first), read within ``http``'s deadlines.

    Each wait for the next chunk is bounded by ``http.body_idle_timeout_s`` and the whole body by
    ``http.body_timeout_s`` (from the first read); the response to a refusal here closes the
    connection (``mmgate.api.server.CloseUnreadBody``).

    Raises:
        GatewayError(UNSUPPORTED_MEDIA_TYPE): 415, not JSON.
        GatewayError(REQUEST_TOO_LARGE): 413, past ``limit`` bytes (declared or streamed).
        GatewayError(REQUEST_TIMEOUT): 408, the body stalled or took too long.
        GatewayError(CLIENT_DISCONNECTED): the client left mid-upload (logged at INFO; no answer reaches it).
    """
    require_json(request)
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
    """A request's body and its hold on the idle trimmer (:meth:`mmgate.memory.IdleTrimmer.hold`).

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
async def request_body(state: GatewayState, request: Request, limit: int) -> AsyncIterator[RequestBody]:
    """The request's body (:func:`read_body` within ``state.settings.http``'s deadlines), held by the idle
    trimmer while the request runs: a large body (a huge prompt) leaves freed heap behind that the
    trimmer returns once the gateway is idle.  Every POST endpoint reads its body through this and hands
    its response to :meth:`RequestBody.answer`, so a streamed answer keeps the hold to its end."""
    data = await read_body(request, limit, state.settings.http)
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


def create_app(state: GatewayState) -> FastAPI:
    """The FastAPI app over ``state`` (workers are probed on start-up, closed on shutdown)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.workers.start()
        try:
            yield
        finally:
            await state.workers.close()
            await state.fetcher.aclose()
            state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="mmgate", lifespan=lifespan)
    app.add_middleware(metrics.RequestTimer)  # mmgate_request_duration_seconds{endpoint,status}
    body_limit = body_limit_for(state.settings)
    register_responses(app, state, body_limit)
    register_anthropic(app, state, body_limit)

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _framework(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        return render_error(request, framework_error(exc.status_code, headers.get("Allow")), headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, _: RequestValidationError) -> Response:
        return render_error(request, framework_error(422))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(GatewayError(ErrorCode.INTERNAL_ERROR, "internal error"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async with request_body(state, request, body_limit) as body:
            req = await parse_off_loop(state, partial(parse_chat_request, limits=state.settings.constraints),
                                       body.data)
            metrics.REQUESTS.labels(state.runtime.served_name, str(req.stream).lower()).inc()
            return body.answer(await until_disconnect(request, answer_chat(req)))

    async def answer_chat(req: ChatCompletionRequest) -> Response:
        answer = await start_chat(state, req)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await respond(answer.prepared, req.stream, include_usage, answer.first, answer.rest,
                             state.runtime.tokenizer, answer.release, answer.headers,
                             parsing=output_parsing(req, state.runtime.bundle.chat_template))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": state.runtime.served_name, "object": "model", "created": int(state.started), "owned_by": "mmgate",
             "root": state.runtime.bundle.name}]})

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while some worker is healthy; else 503 with the error body of ``no_healthy_worker`` too
        (not counted in the error metrics: a health poll is not a failed request)."""
        healthy = sum(1 for w in state.workers.workers if w.healthy)
        body: dict[str, object] = {"status": "ok" if healthy else "unavailable", "healthy_workers": healthy,
                                   "workers": len(state.workers.workers)}
        if healthy:
            return JSONResponse(body)
        exc = GatewayError(ErrorCode.NO_HEALTHY_WORKER, "no healthy worker")
        return JSONResponse({**body, **exc.body()}, status_code=exc.status,
                            headers={"X-SMG-Error-Code": exc.code.value, "Retry-After": "1"})

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse({"workers": [
            {"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight, "labels": w.labels,
             "consecutive_failures": w.failures, "busy_probes": w.busy_probes, "last_probe": w.last_probe}
            for w in state.workers.workers]})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app
