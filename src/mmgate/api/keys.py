"""The key guard: every request's key is checked by path before anything reads its body (docs/security.md).

Stage: api, in front of the routes (an ASGI middleware, :class:`KeyGuard`).  In: the request's method,
path and headers; out: the request passed on untouched, or a refusal sent at once, without reading one
byte of the body (so no body is parsed, no plan made, no media fetched; the server then closes the
connection, :class:`mmgate.api.server.CloseUnreadBody`).

The rule is by path, not by route, so a route added later is covered the day it is added
(:func:`path_kind`):

* ``/v1`` and everything under it (vLLM's rule, ``AuthenticationMiddleware``: ``url_path.startswith("/v1")``)
  needs one of ``--api-key``: ``Authorization: Bearer KEY`` (the scheme in any case, as vLLM), and under
  ``/v1/messages`` also Anthropic's ``x-api-key: KEY``.  No ``--api-key``: open.
* The admin API, ``/workers/...`` (any method) and ``/workers`` other than ``GET``/``HEAD``, needs one of
  ``--admin-api-key`` as ``Authorization: Bearer KEY``; without ``--admin-api-key`` it is refused, 403
  ``admin_api_disabled``.  (The Rust gateway leaves its admin routes open when no key at all is set and
  falls back to ``--api-key`` when no control-plane key is; mmgate never opens them without their own key.)
* Every other path (``/health``, ``/metrics``, ``GET /workers``, FastAPI's ``/docs``, unknown paths) is open,
  unless ``--protect-ops``: then an ``--api-key`` or an ``--admin-api-key`` opens it.

A missing or wrong key is 401 ``invalid_api_key`` in the path's error shape (the renderer the app hands
in: Anthropic's under ``/v1/messages``, else ``{"error": {...}}`` with ``X-SMG-Error-Code``) plus
``WWW-Authenticate: Bearer`` (``realm="control-plane"`` on the admin API, as the Rust gateway's
``control_plane_auth_middleware``).  Keys are compared as SHA-256 digests with :func:`hmac.compare_digest`
against every configured key, without stopping at a match (vLLM's ``verify_token``); the presented key is
never logged, echoed or used as a metric label.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum

from fastapi import Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from mmgate.api.anthropic import is_anthropic_path
from mmgate.config.auth import AuthSettings, key_digest
from mmgate.errors import ErrorCode, GatewayError

#: the app's rendering of an error for a request (``mmgate.api.app.render_error``)
Render = Callable[[Request, GatewayError, dict[str, str]], Response]

API_PREFIX = "/v1"
WORKERS_PATH = "/workers"
_READS = ("GET", "HEAD")


class PathKind(StrEnum):
    """Which keys open a path."""

    API = "api"  # /v1...: --api-key
    ADMIN = "admin"  # the admin API: --admin-api-key
    OPS = "ops"  # everything else: open, or --api-key / --admin-api-key with --protect-ops


def path_kind(method: str, path: str) -> PathKind:
    """The :class:`PathKind` of a request (``path`` without the app's root path)."""
    if path.startswith(API_PREFIX):
        return PathKind.API
    if path.startswith(WORKERS_PATH + "/") or (path == WORKERS_PATH and method not in _READS):
        return PathKind.ADMIN
    return PathKind.OPS


def presented_keys(headers: Iterable[tuple[bytes, bytes]], x_api_key: bool) -> list[bytes]:
    """The keys a request presents: the token of its first ``Authorization: Bearer`` header, and with
    ``x_api_key`` the value of its first ``x-api-key`` header (empty values left out)."""
    bearer: bytes | None = None
    anthropic: bytes | None = None
    for name, value in headers:
        name = name.lower()
        if name == b"authorization" and bearer is None:
            scheme, _, token = value.strip().partition(b" ")
            bearer = token.strip() if scheme.lower() == b"bearer" else b""
        elif name == b"x-api-key" and x_api_key and anthropic is None:
            anthropic = value.strip()
    return [k for k in (bearer, anthropic) if k]


def key_matches(presented: Sequence[bytes], digests: Sequence[bytes]) -> bool:
    """Whether one of ``presented`` is one of the keys whose :func:`~mmgate.config.auth.key_digest` are
    ``digests``: every pair is compared in constant time (:func:`hmac.compare_digest` on 32-byte digests,
    so neither a key's bytes nor its length shows in the time), none skipped after a match."""
    found = False
    for key in presented:
        candidate = key_digest(key)
        for digest in digests:
            found |= hmac.compare_digest(candidate, digest)
    return found


def refusal(auth: AuthSettings, method: str, path: str,
            headers: Iterable[tuple[bytes, bytes]]) -> tuple[GatewayError, dict[str, str]] | None:
    """Why a request may not pass (the error and the headers its answer adds), or None: it may.

    Never names the key presented, nor a configured one.
    """
    kind = path_kind(method, path)
    if kind is PathKind.ADMIN and not auth.admin_keys:
        return GatewayError(ErrorCode.ADMIN_API_DISABLED,
                            "the admin API is off: start the gateway with --admin-api-key"), {}
    digests = {PathKind.API: auth.api_keys, PathKind.ADMIN: auth.admin_keys,
               PathKind.OPS: auth.api_keys + auth.admin_keys if auth.protect_ops else ()}[kind]
    if not digests:
        return None
    anthropic = kind is PathKind.API and is_anthropic_path(path)
    presented = presented_keys(headers, x_api_key=anthropic)
    if key_matches(presented, digests):
        return None
    how = "x-api-key: <key> or Authorization: Bearer <key>" if anthropic else "Authorization: Bearer <key>"
    what = "admin API key" if kind is PathKind.ADMIN else "API key"
    message = f"invalid {what}" if presented else f"missing {what}: send {how}"
    challenge = 'Bearer realm="control-plane"' if kind is PathKind.ADMIN else "Bearer"
    return GatewayError(ErrorCode.INVALID_API_KEY, message), {"WWW-Authenticate": challenge}


class KeyGuard:
    """ASGI middleware: :func:`refusal` for each HTTP request before the app sees it; a refused request is
    answered with ``render`` (the app's error rendering) without reading its body, a refused WebSocket is
    closed (1008, policy violation) before it is accepted."""

    def __init__(self, app: ASGIApp, auth: AuthSettings, render: Render) -> None:
        self.app = app
        self.auth = auth
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        refused = refusal(self.auth, scope.get("method", "GET"), path, scope["headers"])
        if refused is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            exc, headers = refused
            await self.render(Request(scope), exc, headers)(scope, receive, send)
