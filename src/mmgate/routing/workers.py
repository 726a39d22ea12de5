"""Worker registry, health and selection.

Stage: select worker.  In: the modalities a prepared request carries; out:
the worker that will run it.  Workers are registered from ``--worker-urls``
(``grpc://HOST:PORT``); each is probed with GetModelInfo / GetServerInfo at
start and health-checked periodically.  Selection takes the healthy worker
with the fewest requests in flight (ties: registration order).

Capability: a worker whose model reports ``supports_vision = false`` cannot
take image or video input; a request carrying them is refused with
``multimodal_not_supported`` (400) rather than failing inside the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mmgate import metrics
from mmgate.engines.vllm_client import VllmWorkerClient, WorkerInfo
from mmgate.errors import ErrorCode, GatewayError
from mmgate.types import Modality

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


@dataclass(slots=True)
class Worker:
    """One engine worker and what is known about it."""

    url: str
    target: str  # host:port
    client: VllmWorkerClient | None = None  # created on the serving event loop (grpc.aio binds to it)
    info: WorkerInfo | None = None
    healthy: bool = False
    in_flight: int = 0
    labels: dict[str, str] = field(default_factory=dict)

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
        wanted = set(modalities)
        if not wanted:
            return True
        return self.info is not None and self.info.supports_vision and wanted <= {Modality.IMAGE, Modality.VIDEO}


class WorkerRegistry:
    """All workers of the served model."""

    def __init__(self, urls: Iterable[str], health_interval_s: float = 5.0) -> None:
        self.workers = [Worker(url=u, target=parse_worker_url(u)) for u in urls]
        self.health_interval_s = health_interval_s
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """Probe every worker once (health, and info until it is known)."""
        await asyncio.gather(*(self._probe(w) for w in self.workers))

    async def _probe(self, worker: Worker) -> None:
        if worker.client is None:
            worker.client = VllmWorkerClient(worker.target)
        healthy = await worker.client.health()
        if healthy:
            try:
                info = await worker.client.info()
            except GatewayError:
                healthy = False
            else:
                worker.info = info
                worker.labels = dict(info.labels)
        if healthy != worker.healthy:
            log.info("worker %s is %s", worker.url, "healthy" if healthy else "unhealthy")
        worker.healthy = healthy
        metrics.WORKER_HEALTHY.labels(worker.url).set(1 if healthy else 0)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.refresh()
            except Exception:  # a probe must never kill the loop
                log.exception("worker health refresh failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(w.client.close() for w in self.workers if w.client is not None))

    def select(self, modalities: Iterable[Modality]) -> Worker:
        """The least-loaded healthy worker that can take ``modalities``.

        Raises:
            GatewayError(MULTIMODAL_NOT_SUPPORTED): healthy workers exist but none takes these modalities.
            GatewayError(NO_HEALTHY_WORKER): no healthy worker (retryable 503).
        """
        wanted = list(modalities)
        healthy = [w for w in self.workers if w.healthy]
        if not healthy:
            raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, "no healthy worker for this model")
        capable = [w for w in healthy if w.accepts(wanted)]
        if not capable:
            names = ", ".join(sorted(m.value for m in wanted))
            raise GatewayError(ErrorCode.MULTIMODAL_NOT_SUPPORTED, f"no worker of this model accepts {names} input")
        chosen = min(capable, key=lambda w: w.in_flight)
        assert chosen.client is not None  # healthy implies probed
        return chosen
