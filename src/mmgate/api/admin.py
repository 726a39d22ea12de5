"""The worker admin API: list, add, inspect and remove workers while the gateway runs.

Stage: api.  Routes: ``GET /workers`` (every worker), ``POST /workers`` (add one), ``GET /workers/{id}``,
``DELETE /workers/{id}``.  Shapes after the Rust gateway's worker API (smg ``model_gateway/src/worker/service.rs``
and ``protocols/worker_spec.rs``, smg 1.13): a worker's ``id`` is a UUID string; an add answers ``worker_id``,
``url`` and ``location`` (also the ``Location`` header), a remove ``worker_id`` and ``status``.  Unlike smg's
queued jobs, an add answers once the worker has been probed and its model found and loaded
(:meth:`mmgate.routing.workers.WorkerRegistry.add`), so it takes no traffic before; a remove drains: the
worker takes no new request, leaves once its requests in flight are done and its channel is closed.
Which callers may use these routes (``--admin-api-key``) is not decided here.

Errors (the one table): a body that is not a JSON object, a URL that is not ``grpc://host:port``, an unknown
role, a bad bootstrap port, a worker id that is not a UUID -> 400 ``invalid_request``; no worker with that id
-> 404 ``worker_not_found``; a URL registered already -> 409 ``worker_exists``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mmgate.api.http import read_body
from mmgate.engines.base import Role
from mmgate.errors import ErrorCode, GatewayError
from mmgate.routing.workers import Worker, WorkerStatus, parse_worker_url

if TYPE_CHECKING:
    from mmgate.gateway.state import GatewayState

#: the largest admin request body read, bytes
ADMIN_BODY_LIMIT = 64 * 1024
#: smg's ``worker_type`` values, accepted for ``role``
_SMG_WORKER_TYPES = {"regular": Role.SINGLE.value}


def worker_info(worker: Worker) -> dict[str, Any]:
    """What ``GET /workers`` and ``GET /workers/{id}`` show of one worker: besides its probe counts and labels,
    ``status`` and ``reason`` (why it is ``failed``; kept while it is tried again), ``admit_failures`` (failed
    admissions in a row) and ``next_admit_in_s`` (a failed worker: seconds until its next try, which a probe
    round that finds it healthy starts; None otherwise)."""
    return {"id": worker.id, "url": worker.url, "model_id": worker.model, "status": worker.status.value,
            "reason": worker.reason, "role": worker.role, "bootstrap_port": worker.bootstrap_port,
            "healthy": worker.healthy, "in_flight": worker.in_flight, "labels": worker.labels,
            "consecutive_failures": worker.failures, "busy_probes": worker.busy_probes,
            "last_probe": worker.last_probe, "admit_failures": worker.admit_failures,
            "next_admit_in_s": (round(max(0.0, worker.retry_at - time.monotonic()), 3)
                                if worker.status is WorkerStatus.FAILED else None)}


def _invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST, message, param)


def parse_new_worker(body: bytes, pd: bool, epd: bool) -> tuple[str, Role | None, int | None]:
    """``POST /workers``' body -> (url, role or None: the one it reports, bootstrap port or None).

    ``{"url": "grpc://host:port", "role": "single|prefill|decode|encode", "bootstrap_port": 1..65535}``;
    ``worker_type`` (smg's name, ``regular`` for single) is taken for ``role``.  ``pd``/``epd``: whether the
    gateway runs prefill/decode (encode) disaggregation, which the roles other than single need.

    Raises:
        GatewayError(INVALID_REQUEST): any field missing or malformed (never echoing it).
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise _invalid("the body is not JSON") from None
    if not isinstance(data, dict):
        raise _invalid("the body must be a JSON object")
    url = data.get("url")
    if not isinstance(url, str):
        raise _invalid("url is required: grpc://HOST:PORT", "url")
    try:
        parse_worker_url(url)
    except ValueError:
        raise _invalid("url must be grpc://HOST:PORT", "url") from None
    field = "role" if "role" in data else "worker_type"
    raw = data.get(field)
    role: Role | None = None
    if raw is not None:
        if not isinstance(raw, str) or _SMG_WORKER_TYPES.get(raw, raw) not in {r.value for r in Role}:
            raise _invalid("role must be one of single, prefill, decode, encode", field)
        role = Role(_SMG_WORKER_TYPES.get(raw, raw))
        if role in (Role.PREFILL, Role.DECODE) and not pd:
            raise _invalid(f"a {role.value} worker needs --pd-disaggregation", field)
        if role is Role.ENCODE and not epd:
            raise _invalid("an encode worker needs --epd-disaggregation", field)
    port = data.get("bootstrap_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise _invalid("bootstrap_port must be an integer 1..65535", "bootstrap_port")
    return url, role, port


def register_admin(app: FastAPI, state: GatewayState) -> None:
    """Add the worker routes (see the module docstring) to ``app``."""
    adding: set[str] = set()  # URLs whose add is under way

    def find(worker_id: str) -> Worker:
        try:
            uuid.UUID(worker_id)
        except ValueError:
            raise _invalid("a worker id is a UUID (see GET /workers)") from None
        worker = state.workers.get(worker_id)
        if worker is None:
            raise GatewayError(ErrorCode.WORKER_NOT_FOUND, "no worker with this id (see GET /workers)")
        return worker

    @app.get("/workers")
    async def list_workers() -> JSONResponse:
        workers = state.workers.workers
        return JSONResponse({"workers": [worker_info(w) for w in workers], "total": len(workers)})

    @app.post("/workers")
    async def add_worker(request: Request) -> JSONResponse:
        body = await read_body(request, ADMIN_BODY_LIMIT, state.settings.http)
        url, role, port = parse_new_worker(body, state.settings.pd_disaggregation, state.settings.epd_disaggregation)
        if url in adding or any(w.url == url for w in state.workers.workers):
            raise GatewayError(ErrorCode.WORKER_EXISTS, "a worker with this url is registered already", "url")
        adding.add(url)
        try:
            worker = await state.workers.add(url, role, port)
        finally:
            adding.discard(url)
        location = f"/workers/{worker.id}"
        return JSONResponse({"status": worker.status.value, "worker_id": worker.id, "url": worker.url,
                             "location": location, "worker": worker_info(worker)},
                            status_code=201, headers={"Location": location})

    @app.get("/workers/{worker_id}")
    async def get_worker(worker_id: str) -> JSONResponse:
        return JSONResponse(worker_info(find(worker_id)))

    @app.delete("/workers/{worker_id}")
    async def remove_worker(worker_id: str) -> JSONResponse:
        worker = find(worker_id)
        state.workers.remove(worker)
        gone = worker not in state.workers.workers
        return JSONResponse({"status": "removed" if gone else WorkerStatus.DRAINING.value, "worker_id": worker.id,
                             "in_flight": worker.in_flight}, status_code=202)
