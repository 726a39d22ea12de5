"""What the policies learn from the workers in the background: ``GetLoads`` polls and KV-event streams.

Stage: select worker (background).  Every ``--load-check-interval`` seconds each healthy worker's ``GetLoads``
answer goes to the policies that want loads (``least_load``, ``power_of_two``; SMG's ``LoadMonitor``, a
fixed 5 s there); each healthy worker's ``SubscribeKvEvents`` stream, where it has one, feeds the policies
that follow KV events (``cache_aware``); a stream that ends or fails is retried at the next poll (a worker
answering ``UNIMPLEMENTED`` is not asked again until it is seen unhealthy).  Every ``--eviction-interval-secs``
seconds each policy's :meth:`~mmgate.routing.policies.base.RoutingPolicy.evict` runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import grpc

from mmgate.config.settings import RoutingSettings
from mmgate.routing.policies.base import RoutingPolicy

log = logging.getLogger("mmgate.routing")


class Followed(Protocol):
    """What the monitor reads of a worker."""

    url: str
    healthy: bool
    client: Any  # mmgate.engines.client.WorkerClient | None


class PolicyMonitor:
    """The background tasks of one registry's policies (see the module docstring)."""

    def __init__(self, workers: Callable[[], Sequence[Followed]], policies: Iterable[RoutingPolicy],
                 routing: RoutingSettings) -> None:
        self._workers = workers
        self.policies = list({id(p): p for p in policies}.values())
        self.routing = routing
        self._tasks: list[asyncio.Task[None]] = []
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._unimplemented: set[str] = set()

    async def poll_once(self) -> None:
        """One round: every healthy worker's GetLoads to the policies that want it, and KV streams opened."""
        workers = [w for w in self._workers() if w.healthy and w.client is not None]
        if any(p.wants_loads for p in self.policies):
            answers = await asyncio.gather(*(w.client.loads(self.routing.load_check_interval_s) for w in workers))
            for worker, load in zip(workers, answers):
                if load is not None:
                    for policy in self.policies:
                        if policy.wants_loads:
                            policy.update_loads(worker.url, load)
        for worker in self._workers():
            if not worker.healthy:
                self._unimplemented.discard(worker.url)
        if any(p.wants_kv_events for p in self.policies):
            for worker in workers:
                task = self._streams.get(worker.url)
                if (task is None or task.done()) and worker.url not in self._unimplemented:
                    self._streams[worker.url] = asyncio.create_task(self._follow(worker))

    async def _follow(self, worker: Followed) -> None:
        following = [p for p in self.policies if p.wants_kv_events]
        try:
            async for batch in worker.client.kv_events():
                for policy in following:
                    policy.on_kv_events(worker.url, batch)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._unimplemented.add(worker.url)
            else:
                log.info("KV event stream of %s ended: %s", worker.url, exc.code().name)
        finally:
            for policy in following:
                policy.on_kv_stream_lost(worker.url)

    async def _loop(self, interval: float, step: Callable[[], Any]) -> None:
        while True:
            try:
                result = step()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # the monitor must never die
                log.exception("routing policy upkeep failed")
            await asyncio.sleep(interval)

    def start(self) -> None:
        """Start polling (now, then every ``--load-check-interval``) and evicting (every ``--eviction-interval-secs``)."""
        self._tasks.append(asyncio.create_task(self._loop(self.routing.load_check_interval_s, self.poll_once)))
        if self.routing.eviction_interval_s > 0:
            async def evict_later() -> None:
                await asyncio.sleep(self.routing.eviction_interval_s)
                await self._loop(self.routing.eviction_interval_s, self.evict)
            self._tasks.append(asyncio.create_task(evict_later()))

    def evict(self) -> None:
        """Run every policy's eviction once."""
        for policy in self.policies:
            policy.evict()

    async def close(self) -> None:
        """Stop every task and stream."""
        tasks = [*self._tasks, *self._streams.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._streams.clear()
