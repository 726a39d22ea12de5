"""Cancel a request's work when its client goes away.

Stage: api.  A handler whose request body has been read hands its whole answer (planning,
fetching, the engine call, and for a non-streamed request the whole completion) to
:func:`until_disconnect`.  When the client disconnects first, the work is cancelled at once:
media fetches and decodes stop, the engine RPC is cancelled (the worker's ``Generate`` sees its
call cancelled and stops generating), the worker slot, the in-flight budget and any shared-memory
segment are released, and nothing more is sent.  A streamed answer is handed back as soon as it
starts; from then on Starlette's ``StreamingResponse`` watches for the disconnect itself and
closes the stream, whose ``finally`` releases the same things.

This is what vLLM's OpenAI server does with ``@with_cancellation``
(``vllm/entrypoints/utils.py`` ``with_cancellation`` / ``listen_for_disconnect``, v0.11).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from fastapi import Request
from fastapi.responses import Response

from mmgate.observe import metrics

log = logging.getLogger("mmgate.api")

#: the status logged for a request whose client left (nginx's convention; the client never sees it)
CLIENT_CLOSED_REQUEST = 499


async def _disconnected(request: Request) -> None:
    """Return when the ASGI server reports ``http.disconnect`` (the body must have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """The response of ``work``, or a 499 for nobody when the client disconnects first (``work`` is
    then cancelled and awaited, so its clean-up has run when this returns).

    The body of ``request`` must have been read completely: the watcher consumes the next ASGI
    message, which can then only be the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself is cancelled (server shutting down)
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise
    if task.done():
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    metrics.CLIENT_DISCONNECTS.inc()
    log.info("client disconnected; its request was cancelled")
    return Response(status_code=CLIENT_CLOSED_REQUEST)
