"""OpenAI chat completions: ``POST /v1/chat/completions`` over the chat pipeline.

Stage: api.  In: an OpenAI chat-completion body (:func:`mmgate.request.parse.parse_chat_request`); out: a
``chat.completion`` object or its SSE chunks (:func:`mmgate.api.responses.respond`), from the
:class:`~mmgate.routing.dispatch.EngineAnswer` that :func:`mmgate.api.answer.start_chat` returns.  The body
is read within ``state.settings.http``'s deadlines and the body limit (:mod:`mmgate.api.http`); the work
is cancelled when the client leaves.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import Response

from mmgate.observe import metrics
from mmgate.api.answer import start_chat
from mmgate.api.disconnect import until_disconnect
from mmgate.api.http import parse_off_loop, request_body
from mmgate.api.output_parsing import output_parsing
from mmgate.api.responses import respond
from mmgate.request.parse import parse_chat_request
from mmgate.request.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from mmgate.gateway.state import GatewayState, ServedModel


async def answer_chat(state: ServedModel, req: ChatCompletionRequest) -> Response:
    """Run ``req`` through :func:`start_chat` on the served model ``state`` and render the answer in the
    chat-completion shape."""
    answer = await start_chat(state, req)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await respond(answer.prepared, req.stream, include_usage, answer.first, answer.rest,
                         state.runtime.tokenizer, answer.release, answer.headers,
                         parsing=output_parsing(req, state.runtime.bundle.chat_template))


def register_chat_completions(app: FastAPI, state: GatewayState, body_limit: int) -> None:
    """Add ``POST /v1/chat/completions`` to ``app`` (an unknown ``model``: 404 ``model_not_found``)."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async with request_body(state, request, body_limit) as body:
            req = await parse_off_loop(state, partial(parse_chat_request, limits=state.settings.constraints),
                                       body.data)
            served = state.model_for(req.model)
            metrics.REQUESTS.labels(served.name, str(req.stream).lower()).inc()
            return body.answer(await until_disconnect(request, answer_chat(served, req)))
