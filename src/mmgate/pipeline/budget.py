"""In-flight media byte budget (``--multimodal-max-inflight-bytes``).

Counts the preprocessed encoder bytes the gateway holds for engines.  A
request acquires its bytes after preprocessing and releases them when the
engine has taken the tensors (its first response) or the request ends,
whichever comes first.

Semantics (as the issue specifies, and SMG's ``multimodal_max_inflight_bytes``):
* a request larger than the whole budget -> 413 ``multimodal_payload_too_large`` at once;
* otherwise it waits up to ``wait_s`` (2 s) for room, FIFO, then 429
  ``multimodal_inflight_budget`` with ``Retry-After``;
* the waiting queue holds at most one budget's worth of bytes: beyond that a
  request gets 429 at once;
* ``None`` means unbounded (every acquire succeeds immediately).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mmgate.observe import metrics
from mmgate.errors import ErrorCode, GatewayError
from mmgate.pipeline.memory import IdleTrimmer


@dataclass
class _Waiter:
    nbytes: int
    future: asyncio.Future[None]


class BudgetGrant:
    """Bytes held by one request; ``release()`` is idempotent."""

    def __init__(self, budget: InflightBudget | None, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes
        self.on_release: Callable[[], None] | None = None  # e.g. the idle trimmer's release

    def release(self) -> None:
        if self._budget is not None:
            budget, self._budget = self._budget, None
            budget._release(self.nbytes)
        if self.on_release is not None:
            fn, self.on_release = self.on_release, None
            fn()


class InflightBudget:
    """A byte budget shared by all requests of one gateway (event-loop confined)."""

    def __init__(self, total_bytes: int | None, wait_s: float = 2.0, trimmer: IdleTrimmer | None = None) -> None:
        if total_bytes is not None and total_bytes <= 0:
            raise ValueError("an in-flight budget must be positive; use None for unbounded")
        self.total = total_bytes
        self.trimmer = trimmer  # told of every grant, bounded or not, to trim the heap when idle (mmgate.pipeline.memory)
        self.wait_s = wait_s
        self.in_use = 0
        self._waiters: deque[_Waiter] = deque()
        self._queued = 0

    def _reject(self, code: ErrorCode, message: str) -> GatewayError:
        metrics.budget_rejected(code.value)
        return GatewayError(code, message)

    async def acquire(self, nbytes: int) -> BudgetGrant:
        """Hold ``nbytes`` (waits for room).

        Raises:
            GatewayError(MULTIMODAL_PAYLOAD_TOO_LARGE): larger than the whole budget (413).
            GatewayError(MULTIMODAL_INFLIGHT_BUDGET): no room in time, or the queue is full (429).
        """
        grant = await self._acquire(nbytes)
        if self.trimmer is not None and nbytes > 0:
            grant.on_release = self.trimmer.hold(nbytes)
        return grant

    async def _acquire(self, nbytes: int) -> BudgetGrant:
        if self.total is None or nbytes == 0:
            return BudgetGrant(None, 0)
        if nbytes > self.total:
            raise self._reject(ErrorCode.MULTIMODAL_PAYLOAD_TOO_LARGE,
                               f"request holds {nbytes} preprocessed bytes, more than the in-flight budget of {self.total}")
        if not self._waiters and self.in_use + nbytes <= self.total:
            self.in_use += nbytes
            self._publish()
            return BudgetGrant(self, nbytes)
        if self._queued + nbytes > self.total:
            raise self._reject(ErrorCode.MULTIMODAL_INFLIGHT_BUDGET, "in-flight media budget is full; retry later")
        waiter = _Waiter(nbytes, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._queued += nbytes
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.wait_s)
        except (TimeoutError, asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                # Granted just as the wait ended: give the bytes back.
                self._release(nbytes)
            else:
                waiter.future.cancel()
                self._remove(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._reject(ErrorCode.MULTIMODAL_INFLIGHT_BUDGET,
                               "in-flight media budget stayed full; retry later") from None
        return BudgetGrant(self, nbytes)

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
            self._queued -= waiter.nbytes
        except ValueError:
            pass
        self._wake()

    def _release(self, nbytes: int) -> None:
        self.in_use -= nbytes
        self._wake()
        self._publish()

    def _wake(self) -> None:
        assert self.total is not None
        while self._waiters and self.in_use + self._waiters[0].nbytes <= self.total:
            waiter = self._waiters.popleft()
            self._queued -= waiter.nbytes
            if waiter.future.done():
                continue
            self.in_use += waiter.nbytes
            waiter.future.set_result(None)
        self._publish()

    def _publish(self) -> None:
        metrics.BUDGET_IN_USE.set(self.in_use)
