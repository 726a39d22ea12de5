"""``cache_aware``: send a request where its prefix was sent before, unless that worker is much busier than
the fleet (smg 1.13 ``cache_aware``, the per-request spill gate of smg >= 1.10).

1. Candidates.  Event-driven (a candidate's ``SubscribeKvEvents`` stream has told of stored blocks): the
   candidates holding the most leading blocks of the request (:mod:`mmgate.routing.policies.kv_index`), when
   any holds one.  Otherwise the approximate tree (:mod:`mmgate.routing.policies.tree`): the candidates that
   were sent the longest prefix of the request's routing key, when that prefix is more than
   ``--cache-threshold`` of the key.  Neither: a cache miss, the least loaded worker.
2. Spill gate (:meth:`CacheAwarePolicy.hot`).  With ``mean`` the healthy candidates' mean requests in flight, a
   worker is *hot* when its requests in flight exceed ``--balance-rel-threshold`` x ``mean`` AND ``mean`` +
   ``margin``, where ``margin = min(--balance-abs-threshold, max(4, 2 * sqrt(mean)))``: the absolute margin is
   capped at two standard deviations of a Poisson in-flight count at that mean, never under four unless the
   flag is lower.  The request goes to the least loaded candidate that is not hot; when every candidate is
   hot, to the least loaded worker that is not hot (every worker hot: the least loaded).
3. Record.  In tree mode the key is recorded for the worker finally chosen, so a spill target becomes an
   additional holder of a hot prefix.  The event-driven index changes only with the workers' events.

Mirrors lightseekorg/smg ``model_gateway/src/policies/cache_aware.rs`` as stored in the search index (a
post-1.10 revision: ``candidate_requires_spill``, ``select_final_from_affinity``) and the smg 1.13.0 ``smg
launch --help`` text of ``--balance-abs-threshold``, whose margin cap that revision lacks: the cap's formula
(two standard deviations of the in-flight count, read as Poisson: ``2 * sqrt(mean)``) follows the help text,
as the 1.13 source was not available.  Where smg breaks ties and resolves misses by its least_load
expected-wait scorer, this policy takes the fewest requests in flight (smg's scorer does the same when no
worker reports loads), then the fewest chosen so far, then the first.

The key is the request's expanded prompt with each media item keyed by its content hash
(:mod:`mmgate.pipeline.routing_key`): a follow-up about the same image matches through the image; a different
image behind the same text parts at its first position.  Every ``--eviction-interval-secs`` seconds each
worker's share of the tree is trimmed to ``--max-tree-size`` values, least recently used first.  SMG's
token-usage thresholds (``--balance-token-usage-threshold``, off by default) are not mirrored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mmgate.engines.loads import KvBatch
from mmgate.routing.policies.base import Candidate, RouteRequest, RoutingPolicy, W, least_loaded
from mmgate.routing.policies.kv_index import WorkerKvIndex
from mmgate.routing.policies.tree import PAGE_SIZE, ApproxTree

#: smg 1.13.0 ``smg launch`` defaults
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
EVICTION_INTERVAL_S = 60.0
MAX_TREE_SIZE = 67108864
#: the floor of the spill gate's capped absolute margin (smg 1.13 ``--balance-abs-threshold`` help)
MIN_SPILL_MARGIN = 4.0


class CacheAwarePolicy(RoutingPolicy):
    """See the module docstring."""

    name = "cache_aware"
    wants_kv_events = True

    def __init__(self, cache_threshold: float = CACHE_THRESHOLD, balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD, max_tree_size: int = MAX_TREE_SIZE,
                 block_size: int = PAGE_SIZE) -> None:
        super().__init__()
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.tree = ApproxTree(block_size)
        self.kv: dict[str, WorkerKvIndex] = {}  # workers whose event stream is followed
        self.processed: dict[str, int] = {}

    def spill_margin(self, mean: float) -> float:
        """The spill gate's absolute margin at a mean of ``mean`` requests in flight:
        ``min(balance_abs_threshold, max(4, 2 * sqrt(mean)))``."""
        return min(float(self.balance_abs_threshold), max(MIN_SPILL_MARGIN, 2.0 * math.sqrt(mean)))

    def hot(self, worker: Candidate, mean: float) -> bool:
        """Whether ``worker`` trips the spill gate at a fleet mean of ``mean`` requests in flight (smg
        ``candidate_requires_spill``, with the 1.13 margin cap)."""
        load = worker.in_flight
        return load > mean * self.balance_rel_threshold and load > mean + self.spill_margin(mean)

    def select(self, workers: Sequence[W], request: RouteRequest) -> W:
        chosen = self._choose(workers, request)
        self.processed[chosen.url] = self.processed.get(chosen.url, 0) + 1
        return chosen

    def _gate(self, workers: Sequence[W], candidates: Sequence[W]) -> W:
        """smg ``select_final_from_affinity``: the least loaded candidate that is not hot; all hot: the least
        loaded worker that is not hot; all workers hot: the least loaded."""
        mean = sum(w.in_flight for w in workers) / len(workers)
        safe = [w for w in candidates if not self.hot(w, mean)]
        if safe:
            return least_loaded(safe, self.processed)
        cool = [w for w in workers if not self.hot(w, mean)]
        return least_loaded(cool or workers, self.processed)

    def _choose(self, workers: Sequence[W], request: RouteRequest) -> W:
        values = request.key.values
        followed = [w for w in workers if w.url in self.kv and self.kv[w.url].held]
        if followed:
            scores = {w.url: self.kv[w.url].matched(request.key) for w in followed}
            top = max(scores.values())
            if top <= 0:
                return least_loaded(workers, self.processed)
            return self._gate(workers, [w for w in followed if scores[w.url] == top])
        matched = self.tree.match(values, {w.url for w in workers})
        chosen = None
        if matched and values:
            top = max(matched.values())
            if top / len(values) > self.cache_threshold:
                chosen = self._gate(workers, [w for w in workers if matched.get(w.url) == top])
        if chosen is None:
            chosen = least_loaded(workers, self.processed)
        self.tree.insert(values, chosen.url)
        return chosen

    def on_kv_events(self, url: str, batch: KvBatch) -> None:
        self.kv.setdefault(url, WorkerKvIndex()).apply(batch)

    def on_kv_stream_lost(self, url: str) -> None:
        self.kv.pop(url, None)

    def remove_worker(self, url: str) -> None:
        super().remove_worker(url)
        self.tree.remove_tenant(url)
        self.kv.pop(url, None)
        self.processed.pop(url, None)

    def evict(self) -> None:
        """Trim each worker's share of the tree to ``max_tree_size`` values (least recently used first)."""
        self.tree.evict(self.max_tree_size)
