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

One budget is shared by every served model (issue 25); each request names its model (the served name), so
``mmgate_mm_inflight_bytes{model}`` shows the bytes each model's requests hold and
``smg_admission_queue_rejected_total{model,reason}`` whose requests were refused.
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
    model: str
    future: asyncio.Future[None]


class BudgetGrant:
    """Bytes held by one request; ``release()`` is idempotent."""

    def __init__(self, budget: InflightBudget | None, nbytes: int, model: str = "") -> None:
        self._budget = budget
        self.nbytes = nbytes
        self.model = model
        self.on_release: Callable[[], None] | None = None  # e.g. the idle trimmer's release

    def release(self) -> None:
        if self._budget is not None:
            budget, self._budget = self._budget, None
            budget._release(self.nbytes, self.model)
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
        self.by_model: dict[str, int] = {}  # served name -> bytes its requests hold (models seen keep a 0)
        self._waiters: deque[_Waiter] = deque()
        self._queued = 0

    def _reject(self, code: ErrorCode, message: str, model: str) -> GatewayError:
        metrics.budget_rejected(code.value, model)
        return GatewayError(code, message)

    async def acquire(self, nbytes: int, model: str) -> BudgetGrant:
        """Hold ``nbytes`` for a request to ``model`` (its served name; the label of the budget's metrics),
        waiting for room.

        Raises:
            GatewayError(MULTIMODAL_PAYLOAD_TOO_LARGE): larger than the whole budget (413).
            GatewayError(MULTIMODAL_INFLIGHT_BUDGET): no room in time, or the queue is full (429).
        """
        grant = await self._acquire(nbytes, model)
        if self.trimmer is not None and nbytes > 0:
            grant.on_release = self.trimmer.hold(nbytes)
        return grant

    async def _acquire(self, nbytes: int, model: str) -> BudgetGrant:
        if self.total is None or nbytes == 0:
            return BudgetGrant(None, 0, model)
        if nbytes > self.total:
            raise self._reject(ErrorCode.MULTIMODAL_PAYLOAD_TOO_LARGE,
                               f"request holds {nbytes} preprocessed bytes, more than the in-flight budget of {self.total}",
                               model)
        if not self._waiters and self.in_use + nbytes <= self.total:
            self._hold(nbytes, model)
            self._publish()
            return BudgetGrant(self, nbytes, model)
        if self._queued + nbytes > self.total:
            raise self._reject(ErrorCode.MULTIMODAL_INFLIGHT_BUDGET, "in-flight media budget is full; retry later",
                               model)
        waiter = _Waiter(nbytes, model, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._queued += nbytes
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), self.wait_s)
        except (TimeoutError, asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                # Granted just as the wait ended: give the bytes back.
                self._release(nbytes, model)
            else:
                waiter.future.cancel()
                self._remove(waiter)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._reject(ErrorCode.MULTIMODAL_INFLIGHT_BUDGET,
                               "in-flight media budget stayed full; retry later", model) from None
        return BudgetGrant(self, nbytes, model)

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
            self._queued -= waiter.nbytes
        except ValueError:
            pass
        self._wake()

    def _hold(self, nbytes: int, model: str) -> None:
        self.in_use += nbytes
        self.by_model[model] = self.by_model.get(model, 0) + nbytes

    def _release(self, nbytes: int, model: str) -> None:
        self.in_use -= nbytes
        self.by_model[model] -= nbytes
        self._wake()
        self._publish()

    def _wake(self) -> None:
        assert self.total is not None
        while self._waiters and self.in_use + self._waiters[0].nbytes <= self.total:
            waiter = self._waiters.popleft()
            self._queued -= waiter.nbytes
            if waiter.future.done():
                continue
            self._hold(waiter.nbytes, waiter.model)
            waiter.future.set_result(None)
        self._publish()

    def _publish(self) -> None:
        for model, held in self.by_model.items():
            metrics.BUDGET_IN_USE.labels(model).set(held)
