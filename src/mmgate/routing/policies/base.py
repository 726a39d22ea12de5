"""The one interface of every routing policy, and what a policy reads of a request and a worker.

Stage: select worker.  In: the healthy workers of the request's role that can take it (each with ``url`` and
``in_flight``), and a :class:`RouteRequest` (its routing key, headers); out: the worker to run it.  Mirrors the
Rust gateway's ``LoadBalancingPolicy`` trait (lightseekorg/smg ``model_gateway/src/policies/mod.rs``:
``select_worker``, ``update_loads``, ``remove_worker``), with the candidates already filtered (health,
capability, wire) by :meth:`mmgate.routing.workers.WorkerRegistry.select`.
"""

from __future__ import annotations

import contextvars
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeVar

from mmgate.engines.loads import KvBatch, WorkerLoad
from mmgate.pipeline.routing_key import EMPTY_KEY, RoutingKey


class Candidate(Protocol):
    """What a policy reads of a worker: its URL (the policy's name for it) and the gateway's own count of
    its requests in flight."""

    @property
    def url(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


W = TypeVar("W", bound=Candidate)

#: the request's HTTP headers (lower-case names), set by the API layer around dispatch (consistent_hashing
#: reads ``X-SMG-Routing-Key`` and the session headers from them)
REQUEST_HEADERS: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("mmgate_request_headers",
                                                                                   default={})


@contextmanager
def request_headers(headers: Mapping[str, str]) -> Iterator[None]:
    """Make ``headers`` the current request's routing headers (names folded to lower case) inside the block."""
    token = REQUEST_HEADERS.set({k.lower(): v for k, v in headers.items()})
    try:
        yield
    finally:
        REQUEST_HEADERS.reset(token)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy reads of a request: its routing key (:mod:`mmgate.pipeline.routing_key`), its headers
    (lower-case names) and the OpenAI ``user`` field."""

    key: RoutingKey = EMPTY_KEY
    headers: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None

    @classmethod
    def current(cls, key: RoutingKey, user: str | None = None) -> RouteRequest:
        """The request being dispatched: ``key``, ``user`` and the headers :func:`request_headers` set."""
        return cls(key, REQUEST_HEADERS.get(), user)


class RoutingPolicy(ABC):
    """One way of choosing a worker (one module per policy in :mod:`mmgate.routing.policies`)."""

    name: ClassVar[str]
    #: whether :class:`~mmgate.routing.policies.monitor.PolicyMonitor` polls ``GetLoads`` for this policy
    wants_loads: ClassVar[bool] = False
    #: whether the monitor subscribes to workers' ``SubscribeKvEvents`` for this policy
    wants_kv_events: ClassVar[bool] = False

    def __init__(self) -> None:
        self.loads: dict[str, WorkerLoad] = {}

    @abstractmethod
    def select(self, workers: Sequence[W], request: RouteRequest) -> W:
        """The worker of ``workers`` (not empty: healthy, of the role, able to take the request) that runs
        ``request``; records the choice where the policy keeps state."""

    def update_loads(self, url: str, load: WorkerLoad) -> None:
        """A fresh ``GetLoads`` answer of worker ``url``."""
        self.loads[url] = load

    def on_kv_events(self, url: str, batch: KvBatch) -> None:
        """A ``KvEventBatch`` of worker ``url`` (only policies with :attr:`wants_kv_events` get them)."""

    def on_kv_stream_lost(self, url: str) -> None:
        """Worker ``url``'s event stream ended: what it said of its cache is no longer followed."""

    def remove_worker(self, url: str) -> None:
        """Forget worker ``url`` (removed from the registry)."""
        self.loads.pop(url, None)

    def evict(self) -> None:
        """Periodic upkeep (``--eviction-interval-secs``); nothing for most policies."""


def least_loaded(workers: Sequence[W], processed: Mapping[str, int] | None = None) -> W:
    """The worker with the fewest requests in flight; ties: the fewest chosen so far (``processed``), then
    the first (SMG ``cache_aware.rs`` ``min_key = (load, processed, idx)``)."""
    done = processed or {}
    return min(workers, key=lambda w: (w.in_flight, done.get(w.url, 0)))
