"""The gateway's keys: ``--api-key``, ``--admin-api-key``, ``--protect-ops`` (docs/security.md).

Stage: start-up.  In: the ``mmgate serve`` parser (:func:`add_auth_options`) and its resolved namespace;
out: an :class:`AuthSettings` holding the SHA-256 digest of each key, never the key itself, so no
settings dump, ``repr`` or log line can show one.  :mod:`mmgate.api.keys` checks requests against it.

Names mirror the references where they exist: ``--api-key`` is vLLM's and the Rust gateway's data-plane key
(vLLM ``vllm/entrypoints/openai/cli_args.py`` ``api_key``, several keys allowed, v0.11; lightseekorg/smg
``model_gateway/src/main.rs`` ``--api-key``, one key plus ``--tenant-api-key``); mmgate reads it from
``MMGATE_API_KEY`` (as vLLM reads ``VLLM_API_KEY``).  The admin key stands where smg has
``--control-plane-api-keys`` (``id:name:role:key`` records); mmgate has one role, so it takes bare keys.
Keys are stored hashed as smg's ``AuthConfig`` does (``model_gateway/src/middleware/auth.rs``) and vLLM's
``AuthenticationMiddleware`` (``vllm/entrypoints/openai/api_server.py``, v0.11).
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass, field

from mmgate.config.options import add_option

ENV_API_KEY = "MMGATE_API_KEY"
ENV_ADMIN_API_KEY = "MMGATE_ADMIN_API_KEY"
ENV_PROTECT_OPS = "MMGATE_PROTECT_OPS"
GROUP_AUTH = "API keys"


def key_digest(key: str | bytes) -> bytes:
    """SHA-256 of a key (text as UTF-8; a header value as its bytes): 32 bytes, the form keys are kept
    and compared in, so a comparison takes the same time whatever the presented key's length."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


@dataclass(frozen=True, slots=True)
class AuthSettings:
    """Which paths need a key, and the digests (:func:`key_digest`) of the keys that open them."""

    api_keys: tuple[bytes, ...] = field(default=(), repr=False)  # digests of --api-key; empty: /v1 is open
    admin_keys: tuple[bytes, ...] = field(default=(), repr=False)  # digests of --admin-api-key; empty: admin API off
    protect_ops: bool = False  # /health, /metrics, GET /workers and every other path need a key too


def add_auth_options(parser: argparse.ArgumentParser) -> None:
    """The ``API keys`` option group of ``mmgate serve``; read back with :func:`auth_settings`."""
    g = parser.add_argument_group(GROUP_AUTH)
    add_option(g, "--api-key", action="extend", nargs="+", default=[], env=(ENV_API_KEY,), metavar="KEY",
               help="keys a client must present on every /v1 path: Authorization: Bearer KEY (also x-api-key: KEY "
                    "on /v1/messages); several: repeat the flag or list them (comma-separated in the variable); "
                    "unset: /v1 is open (docs/security.md)")
    add_option(g, "--admin-api-key", action="extend", nargs="+", default=[], env=(ENV_ADMIN_API_KEY,),
               metavar="KEY",
               help="keys of the admin API (POST /workers, GET and DELETE /workers/{id}): Authorization: Bearer KEY; "
                    "unset: the admin API answers 403 admin_api_disabled")
    add_option(g, "--protect-ops", action="store_true", default=False, env=(ENV_PROTECT_OPS,),
               help="/health, /metrics, GET /workers and every other path outside /v1 need an --api-key or "
                    "--admin-api-key too")


def auth_settings(ns: argparse.Namespace) -> AuthSettings:
    """The :class:`AuthSettings` of a namespace parsed with :func:`add_auth_options` and resolved.

    Raises:
        SystemExit: an empty key, a key given both as ``--api-key`` and ``--admin-api-key`` (each key opens
            one side only), or ``--protect-ops`` with no key at all.  The message never quotes a key.
    """
    api = [k.strip() for k in ns.api_key or []]
    admin = [k.strip() for k in ns.admin_api_key or []]
    if not all(api) or not all(admin):
        raise SystemExit("--api-key and --admin-api-key must not be empty")
    if set(api) & set(admin):
        raise SystemExit("a key may not be both an --api-key and an --admin-api-key")
    if ns.protect_ops and not (api or admin):
        raise SystemExit("--protect-ops needs an --api-key or an --admin-api-key")
    return AuthSettings(api_keys=tuple(dict.fromkeys(map(key_digest, api))),
                        admin_keys=tuple(dict.fromkeys(map(key_digest, admin))), protect_ops=bool(ns.protect_ops))
