"""The FastAPI app factory: the endpoints, the one error handler, the gateway's own routes.

Routes: ``POST /v1/chat/completions`` (:mod:`mmgate.api.chat_completions`), ``POST /v1/responses``
(:mod:`mmgate.api.openai_responses`), ``POST /v1/audio/transcriptions`` (:mod:`mmgate.api.transcriptions`),
``POST /v1/messages`` (Anthropic shapes, errors included;
:mod:`mmgate.api.anthropic`), the worker routes ``/workers`` and ``/workers/{id}`` (:mod:`mmgate.api.admin`),
each registered on the app by its module; ``GET /v1/models`` (every served model, with its modalities),
``GET /health``, ``GET /metrics`` here.  The state they share is
:class:`mmgate.gateway.state.GatewayState`; bodies and the rendering of errors are :mod:`mmgate.api.http`'s.
All failures go through one handler that renders the error table (:mod:`mmgate.errors`): body
``{"error": {...}}`` plus ``X-SMG-Error-Code``; unexpected exceptions become 500 ``internal_error``
without a stack trace in the body (it is logged).  The framework's own refusals (an unknown route, a wrong
method, FastAPI's validation) are codes of the same table (:func:`mmgate.api.http.framework_error`), in
Anthropic's shape under ``/v1/messages`` (:func:`render_error`).  Stage timings of each request travel
back in the ``X-Mmgate-Stage-Ms`` header (``stage=ms,...``).  Keys are checked by
:class:`mmgate.api.keys.KeyGuard` before any route runs or any body is read.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmgate.observe import metrics
from mmgate.api.admin import register_admin
from mmgate.api.anthropic import anthropic_error_response, is_anthropic_path, register_anthropic
from mmgate.api.chat_completions import register_chat_completions
from mmgate.api.http import body_limit_for, error_response, framework_error
from mmgate.api.keys import KeyGuard
from mmgate.api.openai_responses import register_responses
from mmgate.api.transcriptions import register_transcriptions
from mmgate.errors import ErrorCode, GatewayError
from mmgate.gateway.state import GatewayState
from mmgate.pipeline.runtime import ModelRuntime
from mmgate.routing.policies.base import request_headers
from mmgate.types import Modality

log = logging.getLogger("mmgate.api")


def render_error(request: Request, exc: GatewayError, headers: dict[str, str] | None = None) -> Response:
    """:func:`error_response`, in Anthropic's shape on a ``/v1/messages`` path; ``headers`` added (a 405's
    ``Allow``)."""
    path = request.scope.get("path", "")
    response = anthropic_error_response(exc, error_response) if is_anthropic_path(path) else error_response(exc)
    response.headers.update(headers or {})
    return response


class RoutingHeaders:
    """ASGI middleware: an HTTP request's headers become the routing headers of the work it starts
    (:func:`mmgate.routing.policies.base.request_headers`), so a policy reads ``X-SMG-Routing-Key``,
    ``X-SMG-Target-Worker`` and the other headers SMG's ``consistent_hashing`` keys on, whatever the endpoint.
    Tasks the route starts copy the context, so the headers reach the worker selection."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        with request_headers(headers):
            await self.app(scope, receive, send)


def model_card(runtime: ModelRuntime, created: float) -> dict[str, object]:
    """One ``/v1/models`` entry (OpenAI's model object, plus vLLM's ``root`` and the ``modalities`` the model
    takes: ``text`` and those its family processes)."""
    family = runtime.family
    media = [] if family is None else [m.value for m in Modality if m in family.processors]
    return {"id": runtime.served_name, "object": "model", "created": int(created), "owned_by": "mmgate",
            "root": runtime.bundle.name, "modalities": ["text", *media]}


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
    app.add_middleware(RoutingHeaders)  # innermost: only requests the key guard let through
    app.add_middleware(KeyGuard, auth=state.settings.auth, render=render_error)  # keys first (docs/security.md)
    app.add_middleware(metrics.RequestTimer)  # mmgate_request_duration_seconds{endpoint,status}
    body_limit = body_limit_for(state.settings)
    register_chat_completions(app, state, body_limit)
    register_responses(app, state, body_limit)
    register_anthropic(app, state, body_limit)
    register_transcriptions(app, state)
    register_admin(app, state)

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

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(m.runtime, state.started)
                                                        for m in list(state.models.values())]})

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while some worker can take traffic (ready: its model loaded, not draining; and healthy); else
        503 with the error body of ``no_healthy_worker`` too (not counted in the error metrics: a health poll
        is not a failed request).  ``healthy_workers`` counts those workers; a worker that answers its probes
        but whose model could not be loaded (``failed``, see ``GET /workers``) or is still loading is not
        counted."""
        workers = state.workers.workers
        healthy = sum(1 for w in workers if w.takes_traffic)
        body: dict[str, object] = {"status": "ok" if healthy else "unavailable", "healthy_workers": healthy,
                                   "workers": len(workers)}
        if healthy:
            return JSONResponse(body)
        exc = GatewayError(ErrorCode.NO_HEALTHY_WORKER, "no worker can take traffic (see GET /workers)")
        return JSONResponse({**body, **exc.body()}, status_code=exc.status,
                            headers={"X-SMG-Error-Code": exc.code.value, "Retry-After": "1"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    return app
