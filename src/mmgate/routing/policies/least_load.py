"""``least_load``: the worker with the least expected wait, from ``GetLoads`` plus the gateway's own count
(SMG ``model_gateway/src/policies/least_load.rs``, "least-(token-)work routing").

Score (lower is better), in seconds, for a worker with a ``GetLoads`` answer::

    (waiting_uncached_tokens + inflight_tokens) / throughput + kv_pressure_weight * k / (1 - k)

``inflight_tokens``: prompt tokens the gateway sent the worker since its last answer (the request's routing-key
length, else ``--least-load-mean-prefill-tokens``), reset by each fresh answer; ``throughput``: its
``gen_throughput``, else ``--least-load-default-throughput``; ``k``: its KV usage, clamped to 0.999.  A worker
without an answer while others have one: ``in_flight * mean_prefill_tokens / fleet throughput``; no worker with
an answer (a fleet that does not report loads): the fewest requests in flight.  Ties: the first.

``--least-load-max-waiting-requests`` N (smg 1.13; 0: off): a worker whose ``GetLoads`` answer reports N or more
waiting requests, counting the requests sent to it since that answer, is skipped while another candidate is
under the cap (smg 1.13 ``smg launch --help``; with every candidate at the cap, all are scored, as smg's overload
protection does when every worker is over its thresholds).
"""

from __future__ import annotations

from collections.abc import Sequence

from mmgate.engines.loads import WorkerLoad
from mmgate.routing.policies.base import Candidate, RouteRequest, RoutingPolicy, W

#: SMG ``DEFAULT_KV_PRESSURE_WEIGHT``, ``DEFAULT_THROUGHPUT``, ``DEFAULT_MEAN_PREFILL_TOKENS``
KV_PRESSURE_WEIGHT = 0.15
DEFAULT_THROUGHPUT = 2000.0
MEAN_PREFILL_TOKENS = 1024


class LeastLoadPolicy(RoutingPolicy):
    """See the module docstring."""

    name = "least_load"
    wants_loads = True

    def __init__(self, kv_pressure_weight: float = KV_PRESSURE_WEIGHT, default_throughput: float = DEFAULT_THROUGHPUT,
                 mean_prefill_tokens: int = MEAN_PREFILL_TOKENS, max_waiting_requests: int = 0) -> None:
        super().__init__()
        self.max_waiting_requests = max_waiting_requests
        self.sent_since_poll: dict[str, int] = {}
        self.kv_pressure_weight = kv_pressure_weight
        self.default_throughput = default_throughput
        self.mean_prefill_tokens = max(1, mean_prefill_tokens)
        self.inflight_tokens: dict[str, int] = {}

    def update_loads(self, url: str, load: WorkerLoad) -> None:
        super().update_loads(url, load)
        self.inflight_tokens[url] = 0
        self.sent_since_poll[url] = 0

    def remove_worker(self, url: str) -> None:
        super().remove_worker(url)
        self.inflight_tokens.pop(url, None)
        self.sent_since_poll.pop(url, None)

    def score(self, worker: Candidate, nominal_throughput: float, fleet_reports: bool) -> float:
        """``worker``'s expected wait in seconds (see the module docstring)."""
        load = self.loads.get(worker.url)
        if load is not None:
            throughput = load.gen_throughput if load.gen_throughput > 0 else self.default_throughput
            k = min(max(load.token_usage, 0.0), 0.999)
            work = load.waiting_uncached_tokens + self.inflight_tokens.get(worker.url, 0)
            return work / throughput + self.kv_pressure_weight * k / (1.0 - k)
        if fleet_reports:
            return worker.in_flight * self.mean_prefill_tokens / nominal_throughput
        return float(worker.in_flight)

    def under_waiting_cap(self, worker: Candidate) -> bool:
        """Whether ``worker`` is under ``--least-load-max-waiting-requests`` (always, when it is 0 or the
        worker has not answered ``GetLoads``)."""
        load = self.loads.get(worker.url)
        if self.max_waiting_requests <= 0 or load is None:
            return True
        return load.waiting + self.sent_since_poll.get(worker.url, 0) < self.max_waiting_requests

    def select(self, workers: Sequence[W], request: RouteRequest) -> W:
        workers = [w for w in workers if self.under_waiting_cap(w)] or list(workers)
        reports = [self.loads[w.url] for w in workers if w.url in self.loads]
        rates = [r.gen_throughput for r in reports if r.gen_throughput > 0]
        nominal = sum(rates) / len(rates) if rates else self.default_throughput
        best = workers[0]
        best_score = self.score(best, nominal, bool(reports))
        for worker in workers[1:]:
            s = self.score(worker, nominal, bool(reports))
            if s < best_score:
                best, best_score = worker, s
        tokens = len(request.key.tokens) or self.mean_prefill_tokens
        self.inflight_tokens[best.url] = self.inflight_tokens.get(best.url, 0) + tokens
        self.sent_since_poll[best.url] = self.sent_since_poll.get(best.url, 0) + 1
        return best
