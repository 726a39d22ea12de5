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
way when the healthy workers cannot take it.  The matrix's second axis, how the model positions its
media (:class:`~mmgate.engines.capabilities.MediaPositions`), narrows both: media of an M-RoPE model
is not taken by an SGLang worker (``mrope_media_not_supported``, 400) unless
``--sglang-allow-mrope-media``.  Its third axis, which ids the model's clip placeholders are
(``MediaPositions.video_ids``), narrows them too: a clip whose ids only some wires embed is not taken by
a worker of any other wire (``multimodal_not_supported``, 400).  A worker whose wire has no adapter in
this gateway is listed and counted, never selected.

Admission (no ``--model``, issue 25): after a worker's first passing probe its model is found and loaded
(:data:`Admit`); it takes traffic once ``ready``.  A worker ``failed`` there (its bundle or model could
not be had) stays ``failed`` with its ``reason`` (no traffic) while it is tried again on a later probe
round that finds it healthy, after a backoff that doubles with each failure in a row: one probe interval,
then two, four, ... at most :data:`ADMIT_RETRY_MAX_S`; so a worker whose bundle becomes available is
admitted without a restart.
Admission runs beside the probe rounds (a slow bundle fetch never delays the other workers' probes);
the first round at start-up and :meth:`WorkerRegistry.add` wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from enum import StrEnum
from functools import partial
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mmgate.observe import metrics
from mmgate.engines.adapter import WireAdapter, adapter_for
from mmgate.engines.base import Capabilities, Probe, ProbeOutcome, Role
from mmgate.engines.capabilities import (
    KIND_MODALITY,
    MediaKind,
    MediaPositions,
    any_wire_takes,
    takes,
    takes_all,
    takes_refs,
)
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


class WorkerStatus(StrEnum):
    """Where a worker stands with its model (``GET /workers``' ``status``).

    ``pending``: no passing probe yet (its model is not known); ``loading``: its model's bundle is being
    fetched and loaded; ``ready``: it may take traffic (when healthy); ``failed``: its bundle or model could
    not be had (``reason`` says why; it takes no traffic; tried again after a backoff, staying ``failed``
    until it is ready); ``draining``: removed, finishing its requests.
    """

    PENDING = "pending"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"


#: the longest wait, seconds, before a failed worker's admission is tried again (the backoff's cap)
ADMIT_RETRY_MAX_S = 60.0

#: ``admit(worker)``: called after a worker's first passing probe (``status`` pending) to find its model, load it
#: and set ``worker.model`` and ``worker.status`` (ready, or failed with a ``reason``); never raises.
Admit = Callable[["Worker"], Awaitable[None]]


@dataclass(slots=True)
class Worker:
    """One engine worker and what is known about it.

    ``id``: a stable string naming it in the admin API (``/workers/{id}``), a UUID as the Rust gateway's
    ``WorkerId`` (smg ``model_gateway/src/worker/service.rs``, ``parse_worker_id``).  ``model``: the model it
    serves (``--model``'s served name; else the ``served_model_name``, or ``model_path``, its GetModelInfo
    reports); "" until known.
    """

    url: str
    target: str  # host:port
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    model: str = ""
    status: WorkerStatus = WorkerStatus.PENDING
    reason: str = ""  # why the worker is failed (its bundle or model could not be had); "" otherwise
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
    #: run once when a draining worker's last request is released (set by :meth:`WorkerRegistry.remove`)
    on_drained: Callable[[], None] | None = None
    removed: bool = False  # taken out by :meth:`WorkerRegistry.remove` (an admission under way must not revive it)
    admit_failures: int = 0  # failed admissions in a row (its bundle or model could not be had); 0 once ready
    retry_at: float = 0.0  # time.monotonic() before which a failed worker's admission is not tried again

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
                if self.in_flight == 0 and self.on_drained is not None:
                    drained, self.on_drained = self.on_drained, None
                    drained()

        return release

    @property
    def serving(self) -> bool:
        """Whether the worker may take new traffic of its model: its model is loaded and it is not draining."""
        return self.status is WorkerStatus.READY

    @property
    def takes_traffic(self) -> bool:
        """Whether a request could be sent to it now: ready (:attr:`serving`) and healthy (what ``/health``
        counts)."""
        return self.serving and self.healthy

    def admission_due(self, now: float) -> bool:
        """Whether its model should be looked for now: never tried (``pending``), or ``failed`` and past its
        backoff (``now``: ``time.monotonic()``)."""
        return self.status is WorkerStatus.PENDING or (self.status is WorkerStatus.FAILED and now >= self.retry_at)

    def reported_model(self) -> str:
        """The model its GetModelInfo reports: ``served_model_name``, else ``model_path`` ("" before a passing
        probe), as the Rust gateway names a gRPC worker's model (``model_id`` from the server's info)."""
        labels = self.caps.labels if self.caps is not None else {}
        return labels.get("served_model_name", "") or labels.get("model_path", "")

    def accepts_refs(self, modalities: Iterable[Modality]) -> bool:
        """Whether this worker takes every one of ``modalities`` as media references it processes itself
        (:data:`mmgate.engines.capabilities.REFS_MATRIX`)."""
        wanted = set(modalities)
        return not wanted or (self.caps is not None and takes_refs(self.caps, wanted))

    def accepts(self, modalities: Iterable[Modality]) -> bool:
        """Whether this worker takes every one of ``modalities`` (its wire x model, the capability matrix)."""
        wanted = set(modalities)
        if not wanted:
            return True
        return self.caps is not None and takes_all(self.caps, wanted)


def _mrope_refusal(what: str, wires: Iterable[str], param: str) -> GatewayError:
    """``mrope_media_not_supported``: ``what`` media of an M-RoPE model, taken only by workers of ``wires``
    that would position it as text."""
    return GatewayError(ErrorCode.MROPE_MEDIA_NOT_SUPPORTED,
                        f"this model positions {what} input with M-RoPE, which the workers that take it "
                        f"(wire: {', '.join(sorted(wires))}) compute as text-only positions from preprocessed "
                        "tensors; use a vLLM or TokenSpeed worker, or start the gateway with "
                        "--sglang-allow-mrope-media to send it anyway (docs/engines-sglang.md)", param)


def _ids_refusal(what: str, wires: Iterable[str], param: str, positions: MediaPositions) -> GatewayError:
    """``multimodal_not_supported``: ``what`` media whose placeholder ids the model's family lays out for some
    wires only (``Family.vllm_video_ids``), taken only by workers of ``wires``, whose engines do not embed them."""
    readers = ", ".join(sorted(w.value for w in positions.id_readers()))
    return GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                        f"this model's {what} placeholder ids are laid out for the {positions.video_ids.value} "
                        f"wire, which the workers that take {what} input (wire: {', '.join(sorted(wires))}) do not "
                        f"embed; use a worker of wire {readers} (docs/engines.md, capability matrix)", param)


def _serves(worker: Worker, role: Role) -> bool:
    """Whether ``worker`` is one :meth:`WorkerRegistry.select` may pick for a leg of ``role``: a worker given a role
    with ``--prefill``/``--decode`` only for that role; any other worker for single requests (as before)."""
    if worker.assigned_role is not None:
        return worker.assigned_role is role
    return role is Role.SINGLE


class WorkerRegistry:
    """The gateway's workers (the root registry), or one model's view of them (:meth:`view`).

    The root holds every worker, probes them and adds or removes them (:meth:`add`, :meth:`remove`); a view
    shares the root's workers and lists only those that serve its model and may take traffic
    (``status`` ready: loaded, not draining), so selection and the dispatchers read one model's workers.
    ``admit``: see :data:`Admit`; None: a worker is ready as soon as it is registered.
    """

    def __init__(self, urls: Iterable[str], policy: HealthPolicy | None = None,
                 prefill: Iterable[tuple[str, int | None]] = (), decode: Iterable[str] = (),
                 encode: Iterable[tuple[str, int | None]] = (),
                 keepalive: KeepaliveSettings = DEFAULT_KEEPALIVE, admit: Admit | None = None,
                 routing: RoutingSettings | None = None, release_sent_min_bytes: int = 0) -> None:
        self._pool = [Worker(url=u, target=parse_worker_url(u)) for u in urls]
        self._pool += [Worker(url=u, target=parse_worker_url(u), assigned_role=Role.PREFILL, bootstrap_port=port)
                       for u, port in prefill]
        self._pool += [Worker(url=u, target=parse_worker_url(u), assigned_role=Role.DECODE) for u in decode]
        self._pool += [Worker(url=u, target=parse_worker_url(u), assigned_role=Role.ENCODE, bootstrap_port=port)
                       for u, port in encode]
        self.policy = policy or HealthPolicy()
        self.keepalive = keepalive  # of every worker's channel (--engine-keepalive-*)
        self.release_sent_min_bytes = release_sent_min_bytes  # of every worker's client (--multimodal-release-*)
        self.admit = admit
        if admit is None:
            for w in self._pool:
                w.status = WorkerStatus.READY
        self._root = True
        self._model: str | None = None  # a view's model; None: every model
        self._task: asyncio.Task[None] | None = None
        self.routing = routing or RoutingSettings()
        #: the policy of each role (--policy, --prefill-policy, --decode-policy; mmgate.routing.policies)
        self.policies = policies_for(self.routing)
        self.monitor = PolicyMonitor(lambda: self._pool, self.policies.values(), self.routing)
        self._closing: set[asyncio.Task[None]] = set()
        self._admissions: dict[str, asyncio.Task[None]] = {}  # worker id -> its admission under way

    @property
    def workers(self) -> list[Worker]:
        """The root: every registered worker (draining ones included); a view: its model's serving workers."""
        if self._root:
            return self._pool
        return [w for w in self._pool if w.serving and (self._model is None or w.model == self._model)]

    def view(self, model: str | None) -> WorkerRegistry:
        """The workers of ``model`` (None: of every model, the one ``--model`` serves) that may take traffic,
        sharing this registry's workers and policy."""
        other = object.__new__(WorkerRegistry)
        other._pool, other.policy, other.keepalive, other.admit = self._pool, self.policy, self.keepalive, self.admit
        other.release_sent_min_bytes = self.release_sent_min_bytes
        other._root, other._model, other._task, other._closing = False, model, None, self._closing
        other._admissions = self._admissions
        other.routing, other.policies, other.monitor = self.routing, self.policies, self.monitor
        return other

    def get(self, worker_id: str) -> Worker | None:
        """The registered worker with this ``id`` (draining ones included), else None."""
        return next((w for w in self._pool if w.id == worker_id), None)

    async def add(self, url: str, role: Role | None = None, bootstrap_port: int | None = None) -> Worker:
        """Register the worker at ``url`` and probe it once (its model found and loaded by ``admit``) before it
        is listed, so it takes no traffic before its capabilities and model are known.

        Raises:
            ValueError: ``url`` is not ``grpc://host:port``.
        """
        worker = Worker(url=url, target=parse_worker_url(url), assigned_role=role, bootstrap_port=bootstrap_port)
        if self.admit is None:
            worker.status = WorkerStatus.READY
        await self._probe(worker)
        self._pool.append(worker)
        return worker

    def remove(self, worker: Worker) -> None:
        """Take ``worker`` out of rotation: it gets no new traffic; once its requests in flight are released it
        leaves the registry and its channel is closed (at once when it has none)."""
        worker.status, worker.removed = WorkerStatus.DRAINING, True

        def drained() -> None:
            if worker in self._pool:
                self._pool.remove(worker)
            for routing_policy in self.policies.values():
                routing_policy.remove_worker(worker.url)
            try:
                metrics.WORKER_HEALTHY.remove(worker.url)
            except KeyError:  # never probed
                pass
            if worker.client is not None:
                task = asyncio.get_running_loop().create_task(worker.client.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

        if worker.in_flight == 0:
            drained()
        else:
            worker.on_drained = drained

    @classmethod
    def from_settings(cls, settings: Settings, admit: Admit | None = None) -> WorkerRegistry:
        """The registry of ``settings.worker_urls`` with the ``--worker-health-*`` policy (``admit``: see
        :data:`Admit`).

        Raises:
            ValueError: a worker URL that is not ``grpc://host:port``, or a bad health policy.
        """
        return cls(settings.worker_urls, HealthPolicy(interval_s=settings.worker_health_interval_s,
                                                      timeout_s=settings.worker_health_timeout_s,
                                                      unhealthy_after=settings.worker_unhealthy_after),
                   prefill=settings.prefill_workers, decode=settings.decode_workers, encode=settings.encode_workers,
                   keepalive=settings.engine_keepalive, admit=admit, routing=settings.routing,
                   release_sent_min_bytes=settings.transport.release_sent_min_bytes)

    @property
    def health_interval_s(self) -> float:
        """Seconds between probe rounds (``policy.interval_s``; settable, e.g. by tests)."""
        return self.policy.interval_s

    @health_interval_s.setter
    def health_interval_s(self, value: float) -> None:
        self.policy = replace(self.policy, interval_s=value)

    async def refresh(self, wait: bool = True) -> None:
        """Probe every worker once (HealthCheck, then GetModelInfo + GetServerInfo for the labels), starting
        the admission of each healthy worker whose admission is due (:meth:`Worker.admission_due`).

        ``wait``: also wait for the admissions under way (False: the background probe rounds).
        """
        await asyncio.gather(*(self._probe(w, wait) for w in list(self._pool)))

    def retry_delay_s(self, failures: int) -> float:
        """Seconds before a worker whose admission failed ``failures`` times in a row is tried again: one
        probe interval, doubled per further failure, at most :data:`ADMIT_RETRY_MAX_S`."""
        return min(self.policy.interval_s * 2.0 ** min(failures - 1, 30), ADMIT_RETRY_MAX_S)

    async def _admit(self, worker: Worker) -> None:
        assert self.admit is not None
        await self.admit(worker)
        if worker.removed:  # removed while its model loaded: it stays out
            worker.status = WorkerStatus.DRAINING
        elif worker.status is WorkerStatus.FAILED:
            worker.admit_failures += 1
            delay = self.retry_delay_s(worker.admit_failures)
            worker.retry_at = time.monotonic() + delay
            log.warning("worker %s: admission failed %d time(s) in a row; next try in %.1f s", worker.url,
                        worker.admit_failures, delay)
        else:
            worker.admit_failures, worker.retry_at = 0, 0.0

    def _admitted(self, worker_id: str, _: asyncio.Task[None]) -> None:
        self._admissions.pop(worker_id, None)

    async def _probe(self, worker: Worker, wait: bool = True) -> None:
        if worker.client is None:
            worker.client = WorkerClient(worker.target, self.keepalive, self.release_sent_min_bytes)
        was = worker.healthy
        probe = await worker.client.probe(self.policy.timeout_s)
        now = time.monotonic()
        healthy = worker.record_probe(probe, self.policy, now, worker.client.last_answer)
        if (healthy and worker.caps is not None and self.admit is not None and not worker.removed
                and worker.admission_due(now) and worker.id not in self._admissions):
            if worker.status is WorkerStatus.PENDING:
                worker.status = WorkerStatus.LOADING  # a failed worker stays failed, with its reason, until ready
            task = asyncio.get_running_loop().create_task(self._admit(worker))
            self._admissions[worker.id] = task
            task.add_done_callback(partial(self._admitted, worker.id))
        admitting = self._admissions.get(worker.id)
        if wait and admitting is not None:
            await asyncio.shield(admitting)
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
                await self.refresh(wait=False)
            except Exception:  # a probe must never kill the loop
                log.exception("worker health refresh failed")

    async def close(self) -> None:
        """Stop probing and close every worker's channel."""
        await self.monitor.close()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        admissions = list(self._admissions.values())
        for task in admissions:
            task.cancel()
        await asyncio.gather(*admissions, return_exceptions=True)
        await asyncio.gather(*(w.client.close() for w in self._pool if w.client is not None), *self._closing)

    def check_kinds(self, kinds: Mapping[MediaKind, str], positions: MediaPositions = MediaPositions()) -> None:
        """Refuse, before anything is fetched, media that no registered worker of the model takes.

        ``kinds``: each kind of media the request carries -> the ``param`` of its first content part.
        ``positions``: how the model positions media; a worker whose wire loses that scheme
        (:meth:`MediaPositions.kept`) takes none of its media, and one whose engine does not embed the
        model's clip placeholder ids (:meth:`MediaPositions.ids_read`) takes none of its clips.
        A kind no wire takes at all (precomputed embeddings) is always refused; any other is refused
        when some worker's capabilities are known and none of them takes it (workers that failed their
        last probe included: their capabilities stand until the next passing probe).  With no worker
        known yet the request goes on (selection decides).

        Raises:
            GatewayError(MULTIMODAL_NOT_SUPPORTED): 400, ``param`` naming the first such part (also: the
                workers that take the kind all fail :meth:`MediaPositions.ids_read`).
            GatewayError(MROPE_MEDIA_NOT_SUPPORTED): 400, the workers that take the kind all lose the model's
                M-RoPE positions (SGLang wire without ``--sglang-allow-mrope-media``).
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
            taking = [caps for caps in known if takes(caps, kind)]
            if not taking:
                wires = ", ".join(sorted({caps.wire.value for caps in known}))
                raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED,
                                   f"no worker of this model takes {kind.value} input (wire: {wires}; "
                                   "docs/engines.md, capability matrix)", param)
            modality = KIND_MODALITY.get(kind)
            reading = [caps for caps in taking if modality is None or positions.ids_read(caps.wire, modality)]
            if not reading:
                raise _ids_refusal(kind.value, {caps.wire.value for caps in taking}, param, positions)
            taking = reading
            if not any(positions.kept(caps.wire) for caps in taking):
                raise _mrope_refusal(kind.value, {caps.wire.value for caps in taking}, param)

    def select(self, modalities: Iterable[Modality], role: Role = Role.SINGLE,
               request: RouteRequest | None = None, positions: MediaPositions = MediaPositions()) -> Worker:
        """The worker ``role``'s policy (:attr:`policies`) picks for ``request`` among the healthy workers of
        ``role`` that can take ``modalities`` and that this gateway has an adapter for (``role`` single: any worker
        not given a prefill/decode role with ``--prefill``/``--decode``).

        ``positions``: how the model positions media; with media, a worker whose wire loses that scheme is
        not capable (:meth:`check_kinds`).

        Raises:
            GatewayError(MULTIMODAL_NOT_SUPPORTED): healthy workers exist but none takes these modalities.
            GatewayError(MROPE_MEDIA_NOT_SUPPORTED): those that take them all lose the model's M-RoPE positions.
            GatewayError(NO_HEALTHY_WORKER): no healthy worker, or none of a wire this gateway speaks
                (retryable 503).
        """
        wanted = list(modalities)
        healthy = [w for w in self.workers if w.healthy and _serves(w, role) and w.status is not WorkerStatus.DRAINING]
        if not healthy:
            what = "" if role is Role.SINGLE else f"{role.value} "
            raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, f"no healthy {what}worker for this model")
        capable = [w for w in healthy if w.accepts(wanted)]
        if not capable:
            names = ", ".join(sorted(m.value for m in wanted))
            raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, f"no worker of this model accepts {names} input")
        if wanted:
            reading = [w for w in capable if w.caps is not None and positions.all_read(w.caps.wire, wanted)]
            if not reading:
                names = ", ".join(sorted(m.value for m in wanted))
                raise _ids_refusal(names, {w.wire for w in capable}, "messages", positions)
            capable = reading
            positioned = [w for w in capable if w.caps is not None and positions.kept(w.caps.wire)]
            if not positioned:
                names = ", ".join(sorted(m.value for m in wanted))
                raise _mrope_refusal(names, {w.wire for w in capable}, "messages")
            capable = positioned
        spoken = [w for w in capable if w.adapter is not None]
        if not spoken:
            wires = ", ".join(sorted({w.wire for w in capable}))
            raise GatewayError(ErrorCode.NO_HEALTHY_WORKER,
                               f"the healthy workers of this model speak {wires}, which this gateway has no adapter for")
        chosen = self.policies.get(role, self.policies[Role.SINGLE]).select(spoken, request or RouteRequest())
        assert chosen.client is not None  # healthy implies probed
        return chosen
