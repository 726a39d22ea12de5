"""The worker's side of the sidecar protocol: is a sidecar there, and process one job.

Stage: worker-side processing with ``--mm-processor redis``.  In: the
unexpanded prompt ids, media references and the request's deadline; out: a
:class:`~mmgate.sidecar.processor.ProcessedPrompt` rebuilt from the sidecar's
result, or an exception that says whose fault the failure is:

* :class:`~mmgate.errors.GatewayError` with the media code the sidecar
  reported (bad URL, disallowed host, fetch timeout, ...), ``param``
  ``media_refs[i]``;
* :class:`SidecarRefused`: the result was too large to push
  (``media_too_large``; the caller's, 400);
* :class:`SidecarUnavailable`: no live sidecar with our fingerprint, the job
  queue full, Redis unreachable, no answer before the deadline, or a
  protocol-level failure (retryable, 503).  A job is sent once: a timeout is
  not retried.

Synchronous (redis-py), called from the engine's gRPC handler threads; the
client's connection pool is thread-safe.  Control calls are bounded by
``control_timeout_s``; the result wait by the job's deadline.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import redis

from mmgate.errors import ErrorCode, GatewayError
from mmgate.sidecar.processor import ProcessedPrompt, item_param
from mmgate.sidecar.protocol import (
    CODE_RESULT_TOO_LARGE,
    SCHEMA_VERSION,
    Job,
    JobItem,
    Keys,
    batch_from_wire,
    decode_result,
    encode,
    hello_text,
)
from mmgate.types import MediaRef

_ERROR_CODES = frozenset(c.value for c in ErrorCode)


class SidecarUnavailable(Exception):
    """A transient failure of the sidecar path (retryable 503)."""


class SidecarRefused(Exception):
    """The sidecar processed the media but refuses to deliver it (the caller's, 400)."""


@dataclass(frozen=True, slots=True)
class Hello:
    """A live sidecar's advertisement."""

    schemes: tuple[str, ...]
    max_result_bytes: int


class SidecarClient:
    """Jobs for the sidecars serving one namespace under one processing fingerprint."""

    def __init__(self, redis_url: str, keys: Keys, fingerprint: str, *, timeout_ms: int = 30_000,
                 max_queue: int = 256, control_timeout_s: float = 1.0, probe_cache_s: float = 0.5) -> None:
        self.keys = keys
        self.fingerprint = fingerprint
        self.timeout_ms = timeout_ms
        self.max_queue = max_queue
        self._control = redis.Redis.from_url(redis_url, socket_connect_timeout=control_timeout_s,
                                             socket_timeout=control_timeout_s)
        # The result wait is bounded by the job's deadline; the socket by that plus a margin.
        self._blocking = redis.Redis.from_url(redis_url, socket_connect_timeout=control_timeout_s,
                                              socket_timeout=timeout_ms / 1000 + 2 * control_timeout_s)
        self._probe_cache_s = probe_cache_s
        self._lock = threading.Lock()
        self._probed: tuple[float, Hello | None] = (float("-inf"), None)
        self._last_problem = ""

    def close(self) -> None:
        self._control.close()
        self._blocking.close()

    def probe(self, fresh: bool = False) -> Hello | None:
        """The live hello of a sidecar with our fingerprint and schema, else None (cached briefly)."""
        with self._lock:
            at, hello = self._probed
            if not fresh and time.monotonic() - at < self._probe_cache_s:
                return hello
        hello = self._read_hello()
        with self._lock:
            self._probed = (time.monotonic(), hello)
        return hello

    def _read_hello(self) -> Hello | None:
        try:
            raw: dict[Any, Any] = self._control.hgetall(self.keys.hello)  # type: ignore[assignment]
        except redis.RedisError as exc:
            self._note(f"redis unreachable: {exc}")
            return None
        if not raw:
            self._note(f"no sidecar hello at {self.keys.hello}")
            return None
        if hello_text(raw, "schema") != str(SCHEMA_VERSION) or hello_text(raw, "fingerprint") != self.fingerprint:
            self._note(f"sidecar at {self.keys.hello} has another fingerprint or schema; ignored")
            return None
        schemes = tuple(s for s in hello_text(raw, "schemes").split(",") if s)
        limit = hello_text(raw, "max_result_bytes")
        self._last_problem = ""
        return Hello(schemes=schemes, max_result_bytes=int(limit) if limit.isdigit() else 0)

    def _note(self, problem: str) -> None:
        self._last_problem = problem

    @property
    def last_problem(self) -> str:
        """Why the last probe found no usable sidecar ('' after a good one)."""
        return self._last_problem

    def process(self, prompt_ids: Sequence[int], refs: Sequence[MediaRef], request_id: str,
                deadline_s: float | None = None) -> ProcessedPrompt:
        """Submit one job and wait for its result until ``deadline_s`` (monotonic seconds) or the timeout.

        Raises:
            GatewayError, SidecarRefused, SidecarUnavailable: see the module docstring.
        """
        if self.probe(fresh=True) is None:
            raise SidecarUnavailable(f"sidecar_unavailable: {self._last_problem}")
        wait_s = self.timeout_ms / 1000
        if deadline_s is not None:
            wait_s = min(wait_s, deadline_s - time.monotonic())
        if wait_s <= 0:
            raise SidecarUnavailable("sidecar_timeout: the request's deadline passed before the job was sent")
        now_ms = int(time.time() * 1000)
        items = [JobItem(modality=r.modality.value, url=r.url) for r in refs]
        job = Job(v=SCHEMA_VERSION, job_id=uuid.uuid4().hex, request_id=request_id, fingerprint=self.fingerprint,
                  prompt_token_ids=list(prompt_ids), items=items, enqueued_ms=now_ms,
                  deadline_ms=now_ms + int(wait_s * 1000))
        try:
            depth = self._control.llen(self.keys.jobs)
            if depth >= self.max_queue:
                raise SidecarUnavailable(f"sidecar_overloaded: {depth} jobs queued (limit {self.max_queue})")
            self._control.lpush(self.keys.jobs, encode(job))
            popped = self._blocking.brpop([self.keys.result(job.job_id)], timeout=max(wait_s, 0.01))
        except redis.RedisError as exc:
            raise SidecarUnavailable(f"sidecar_unavailable: redis: {exc}") from None
        if popped is None:
            raise SidecarUnavailable(f"sidecar_timeout: no result for job {job.job_id} within {int(wait_s * 1000)} ms")
        return self._result(job, cast(bytes, popped[1]))

    def _result(self, job: Job, raw: bytes) -> ProcessedPrompt:
        try:
            result = decode_result(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise SidecarUnavailable(f"sidecar_protocol: undecodable result: {exc}") from None
        if result.v != SCHEMA_VERSION or result.job_id != job.job_id:
            raise SidecarUnavailable(f"sidecar_protocol: result v{result.v} for job {result.job_id}")
        if not result.ok:
            item = result.item if result.item >= 0 else None
            if result.code == CODE_RESULT_TOO_LARGE:
                raise SidecarRefused(f"media_too_large: {result.message}")
            if result.code in _ERROR_CODES:
                raise GatewayError(ErrorCode(result.code), result.message,
                                   item_param(item) if item is not None else None)
            raise SidecarUnavailable(f"{result.code or 'processor_error'}: {result.message}")
        if result.fingerprint != self.fingerprint:
            raise SidecarUnavailable("fingerprint_mismatch: the result was made under other settings")
        try:
            batches = tuple(batch_from_wire(b) for b in result.batches)
        except (GatewayError, ValueError) as exc:
            raise SidecarUnavailable(f"sidecar_protocol: malformed tensors: {exc}") from None
        return ProcessedPrompt(input_ids=tuple(result.prompt_token_ids), batches=batches,
                               timings_ms=dict(result.timing_ms))
