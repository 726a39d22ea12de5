"""Worker registry, health and selection.

Stage: select worker.  In: the modalities a prepared request carries; out:
the worker that will run it.  Workers are registered from ``--worker-urls``
(``grpc://HOST:PORT``); each is probed at start and periodically through the
engine seam (:class:`mmgate.engines.client.WorkerClient`): the engine it runs is
detected without a flag (the first engine service whose ``HealthCheck`` answers,
as SMG detects it), and its GetModelInfo / GetServerInfo become typed
:class:`~mmgate.engines.base.Capabilities`.  Selection takes the healthy, capable
workers of the request's role and lets the role's routing policy (:mod:`mmgate.routing.policies`,
``--policy``) pick one.

Health tells busy from dead (:class:`HealthPolicy`, :meth:`Worker.record_probe`):
* a probe that passes makes the worker healthy at once and clears its count;
* nothing listening (``UNAVAILABLE``) or a worker that answers "not healthy"
  makes it unhealthy at once: it said so, or it is gone;
* a probe that times out while the worker has requests in flight is *busy*, not
  a failure, as long as the worker gave any answer (a probe, a Generate stream
  message) within ``busy_grace_s``;
* any other failed probe counts; ``unhealthy_after`` consecutive ones make the
  worker unhealthy.
The counts are shown by ``GET /workers``, with each worker's labels: what its
GetModelInfo / GetServerInfo say (``supports_vision``, ``shm_namespace_id``,
``mm_processor``, ``mm_processor_source``, ``mm_media_ref_schemes``, ...) plus
``wire`` (the engine protocol detected: ``vllm``, ``sglang``, ``tokenspeed``) and
``role`` (``single``, ``prefill``, ``decode``, ``encode``: the role the worker was
given, else the one it reports), as SMG's ``/workers`` shows them.

Capability (:mod:`mmgate.engines.capabilities`): a worker takes the modalities of its
wire's row of the capability matrix that its model takes.  A request whose media no
registered worker takes is refused with ``multimodal_not_supported`` (400) before
anything is fetched (:meth:`WorkerRegistry.check_kinds`); selection refuses the same
way when the healthy workers cannot take it.  A worker whose wire has no adapter in
this gateway is listed and counted, never selected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mmgate.observe import metrics
from mmgate.engines.adapter import WireAdapter, adapter_for
from mmgate.engines.base import Capabilities, Probe, ProbeOutcome, Role
from mmgate.engines.capabilities import MediaKind, any_wire_takes, takes, takes_all
from mmgate.engines.client import DEFAULT_KEEPALIVE, WorkerClient
from mmgate.errors import ErrorCode, GatewayError
from mmgate.config.settings import RoutingSettings
from mmgate.routing.policies import policies_for
from mmgate.routing.policies.base import RouteRequest
from mmgate.routing.policies.monitor import PolicyMonitor
from mmgate.types import Modality

if TYPE_CHECKING:
    from mmgate.config.settings import KeepaliveSettings, Settings

log = logging.getLogger("mmgate.routing")


def parse_worker_url(url: str) -> str:
    """``grpc://host:port`` -> ``host:port``.

    Raises:
        ValueError: not a grpc URL with a port.
    """
    if not url.startswith("grpc://"):
        raise ValueError(f"worker URL must start with grpc:// (got {url!r})")
    target = url[len("grpc://"):].rstrip("/")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"worker URL needs host:port (got {url!r})")
    return target


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """How workers are probed and when a failing one is marked unhealthy (see the module docstring)."""

    interval_s: float = 5.0  # seconds between probe rounds (--worker-health-interval)
    timeout_s: float = 2.0  # deadline of each probe RPC (--worker-health-timeout)
    unhealthy_after: int = 3  # consecutive counted failures that mark a worker unhealthy (--worker-unhealthy-after)
    busy_grace_s: float = 60.0  # how long a worker with requests in flight may go without any answer

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.busy_grace_s < 0 or self.unhealthy_after < 1:
            raise ValueError("health interval and timeout must be positive, unhealthy_after at least 1")


@dataclass(slots=True)
class Worker:
    """One engine worker and what is known about it."""

    url: str
    target: str  # host:port
    client: WorkerClient | None = None  # created on the serving event loop (grpc.aio binds to it)
    caps: Capabilities | None = None  # what the last passing probe said; kept through failed probes
    healthy: bool = False
    in_flight: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    failures: int = 0  # consecutive failed probes (busy timeouts excluded); 0 after any pass
    busy_probes: int = 0  # consecutive probes that timed out while busy (not counted as failures)
    last_probe: str = ""  # ProbeOutcome of the last probe, or "busy"
    wire: str = ""  # the engine protocol detected (label ``wire``); "" until a probe reaches the worker
    assigned_role: Role | None = None  # the role the gateway gave this worker (None: the one it reports)
    bootstrap_port: int | None = None  # ``--prefill URL BOOTSTRAP_PORT``; None: the one the worker reports

    def __post_init__(self) -> None:
        self._label_wire_and_role()

    @property
    def role(self) -> str:
        """``single | prefill | decode | encode`` (label ``role``): the assigned role, else the reported one."""
        if self.assigned_role is not None:
            return self.assigned_role.value
        return self.caps.role.value if self.caps is not None else Role.SINGLE.value

    @property
    def adapter(self) -> WireAdapter | None:
        """The engine adapter of this worker's wire (None: not detected yet, or none registered for it)."""
        return adapter_for(self.wire)

    def _label_wire_and_role(self) -> None:
        self.labels = {**self.labels, "wire": self.wire, "role": self.role}

    def record_probe(self, probe: Probe, policy: HealthPolicy, now: float, last_answer: float) -> bool:
        """Apply one probe's result to ``healthy`` and the counts; returns the new ``healthy``.

        ``now`` and ``last_answer`` (when the worker last answered anything) are ``time.monotonic()`` seconds.
        """
        outcome = probe.outcome
        if probe.wire is not None:
            self.wire = probe.wire.value
            self._label_wire_and_role()
        if outcome is ProbeOutcome.OK:
            self.failures = self.busy_probes = 0
            self.healthy = True
            if probe.capabilities is not None:
                self.caps = probe.capabilities
                self.wire = probe.capabilities.wire.value
                self.labels = dict(probe.capabilities.labels)
                self._label_wire_and_role()
            self.last_probe = outcome.value
            return True
        if (outcome is ProbeOutcome.TIMEOUT and self.in_flight > 0
                and now - last_answer <= policy.busy_grace_s):
            self.busy_probes += 1
            self.last_probe = "busy"
            return self.healthy
        self.busy_probes = 0
        self.failures += 1
        self.last_probe = outcome.value
        if outcome in (ProbeOutcome.UNREACHABLE, ProbeOutcome.NOT_SERVING) or self.failures >= policy.unhealthy_after:
            self.healthy = False
        return self.healthy

    def hold(self, *also: Callable[[], object]) -> Callable[[], None]:
        """Count one request in flight on this worker; returns an idempotent release that also runs ``also``."""
        self.in_flight += 1
        metrics.ACTIVE_REQUESTS.inc()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1
                metrics.ACTIVE_REQUESTS.dec()
                for fn in also:
                    fn()

        return release

    def accepts(self, modalities: Iterable[Modality]) -> bool:
        """Whether this worker takes every one of ``modalities`` (its wire x model, the capability matrix)."""
        wanted = set(modalities)
        if not wanted:
            return True
        return self.caps is not None and takes_all(self.caps, wanted)


def _serves(worker: Worker, role: Role) -> bool:
    """Whether ``worker`` is one :meth:`WorkerRegistry.select` may pick for a leg of ``role``: a worker given a role
    with ``--prefill``/``--decode`` only for that role; any other worker for single requests (as before)."""
    if worker.assigned_role is not None:
        return worker.assigned_role is role
    return role is Role.SINGLE


class WorkerRegistry:
    """All workers of the served model."""

    def __init__(self, urls: Iterable[str], policy: HealthPolicy | None = None,
                 prefill: Iterable[tuple[str, int | None]] = (), decode: Iterable[str] = (),
                 encode: Iterable[tuple[str, int | None]] = (),
                 keepalive: KeepaliveSettings = DEFAULT_KEEPALIVE, routing: RoutingSettings | None = None) -> None:
        self.workers = [Worker(url=u, target=parse_worker_url(u)) for u in urls]
        self.workers += [Worker(url=u, target=parse_worker_url(u), assigned_role=Role.PREFILL, bootstrap_port=port)
                         for u, port in prefill]
        self.workers += [Worker(url=u, target=parse_worker_url(u), assigned_role=Role.DECODE) for u in decode]
        self.workers += [Worker(url=u, target=parse_worker_url(u), assigned_role=Role.ENCODE, bootstrap_port=port)
                         for u, port in encode]
        self.policy = policy or HealthPolicy()
        self.keepalive = keepalive  # of every worker's channel (--engine-keepalive-*)
        self._task: asyncio.Task[None] | None = None
        self.routing = routing or RoutingSettings()
        #: the policy of each role (--policy, --prefill-policy, --decode-policy; mmgate.routing.policies)
        self.policies = policies_for(self.routing)
        self.monitor = PolicyMonitor(lambda: self.workers, self.policies.values(), self.routing)

    @classmethod
    def from_settings(cls, settings: Settings) -> WorkerRegistry:
        """The registry of ``settings.worker_urls`` with the ``--worker-health-*`` policy.

        Raises:
            ValueError: a worker URL that is not ``grpc://host:port``, or a bad health policy.
        """
        return cls(settings.worker_urls, HealthPolicy(interval_s=settings.worker_health_interval_s,
                                                      timeout_s=settings.worker_health_timeout_s,
                                                      unhealthy_after=settings.worker_unhealthy_after),
                   prefill=settings.prefill_workers, decode=settings.decode_workers, encode=settings.encode_workers,
                   keepalive=settings.engine_keepalive, routing=settings.routing)

    @property
    def health_interval_s(self) -> float:
        """Seconds between probe rounds (``policy.interval_s``; settable, e.g. by tests)."""
        return self.policy.interval_s

    @health_interval_s.setter
    def health_interval_s(self, value: float) -> None:
        self.policy = replace(self.policy, interval_s=value)

    async def refresh(self) -> None:
        """Probe every worker once (HealthCheck, then GetModelInfo + GetServerInfo for the labels)."""
        await asyncio.gather(*(self._probe(w) for w in self.workers))

    async def _probe(self, worker: Worker) -> None:
        if worker.client is None:
            worker.client = WorkerClient(worker.target, self.keepalive)
        was = worker.healthy
        probe = await worker.client.probe(self.policy.timeout_s)
        healthy = worker.record_probe(probe, self.policy, time.monotonic(), worker.client.last_answer)
        if healthy != was:
            log.warning("worker %s is %s (probe: %s, %d consecutive failures)", worker.url,
                        "healthy" if healthy else "unhealthy", probe.outcome.value, worker.failures)
        metrics.WORKER_HEALTHY.labels(worker.url).set(1 if healthy else 0)

    async def start(self) -> None:
        """Probe every worker once, then every ``policy.interval_s`` seconds in the background."""
        await self.refresh()
        self._task = asyncio.create_task(self._loop())
        self.monitor.start()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                await self.refresh()
            except Exception:  # a probe must never kill the loop
                log.exception("worker health refresh failed")

    async def close(self) -> None:
        """Stop probing and close every worker's channel."""
        await self.monitor.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(w.client.close() for w in self.workers if w.client is not None))

    def check_kinds(self, kinds: Mapping[MediaKind, str]) -> None:
        """Refuse, before anything is fetched, media that no registered worker of the model takes.

        ``kinds``: each kind of media the request carries -> the ``param`` of its first content part.
        A kind no wire takes at all (precomputed embeddings) is always refused; any other is refused
        when some worker's capabilities are known and none of them takes it (workers that failed their
        last probe included: their capabilities stand until the next passing probe).  With no worker
        known yet the request goes on (selection decides).

        Raises:
            GatewayError(MULTIMODAL_NOT_SUPPORTED): 400, ``param`` naming the first such part.
        """
        for kind, param in kinds.items():
            if not any_wire_takes(kind):
                raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                                   f"{kind.value} input is taken by no engine wire (docs/engines.md, capability matrix)",
                                   param)
        known = [w.caps for w in self.workers if w.caps is not None]
        if not known:
            return
        for kind, param in kinds.items():
            if not any(takes(caps, kind) for caps in known):
                wires = ", ".join(sorted({caps.wire.value for caps in known}))
                raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                                   f"no worker of this model takes {kind.value} input (wire: {wires}; "
                                   "docs/engines.md, capability matrix)", param)

    def select(self, modalities: Iterable[Modality], role: Role = Role.SINGLE,
               request: RouteRequest | None = None) -> Worker:
        """The worker ``role``'s policy (:attr:`policies`) picks for ``request`` among the healthy workers of
        ``role`` that can take ``modalities`` and that this gateway has an adapter for (``role`` single: any worker
        not given a prefill/decode role with ``--prefill``/``--decode``).

        Raises:
            GatewayError(MULTIMODAL_NOT_SUPPORTED): healthy workers exist but none takes these modalities.
            GatewayError(NO_HEALTHY_WORKER): no healthy worker, or none of a wire this gateway speaks
                (retryable 503).
        """
        wanted = list(modalities)
        healthy = [w for w in self.workers if w.healthy and _serves(w, role)]
        if not healthy:
            what = "" if role is Role.SINGLE else f"{role.value} "
            raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, f"no healthy {what}worker for this model")
        capable = [w for w in healthy if w.accepts(wanted)]
        if not capable:
            names = ", ".join(sorted(m.value for m in wanted))
            raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, f"no worker of this model accepts {names} input")
        spoken = [w for w in capable if w.adapter is not None]
        if not spoken:
            wires = ", ".join(sorted({w.wire for w in capable}))
            raise GatewayError(ErrorCode.NO_HEALTHY_WORKER,
                               f"the healthy workers of this model speak {wires}, which this gateway has no adapter for")
        chosen = self.policies.get(role, self.policies[Role.SINGLE]).select(spoken, request or RouteRequest())
        assert chosen.client is not None  # healthy implies probed
        return chosen
