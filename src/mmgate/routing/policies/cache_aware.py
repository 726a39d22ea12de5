"""``cache_aware``: send a request where its prefix was sent before, unless the load is out of balance
(SMG ``model_gateway/src/policies/cache_aware.rs``).

1. Imbalance (as SMG ``is_imbalanced``): when the busiest and idlest candidates differ by more than
   ``--balance-abs-threshold`` requests in flight *and* the busiest has more than ``--balance-rel-threshold``
   times the idlest's, the least loaded worker is taken (ties: the fewest chosen so far, then the first), and
   the request's key is recorded for it.
2. Event-driven (a candidate's ``SubscribeKvEvents`` stream has told of stored blocks): the candidate holding
   the most leading blocks of the request (:mod:`mmgate.routing.policies.kv_index`), ties to the less loaded;
   none holds any: the least loaded.
3. Approximate tree (:mod:`mmgate.routing.policies.tree`): the candidate that was sent the longest prefix of
   the request's routing key, when that prefix is more than ``--cache-threshold`` of the key; otherwise the
   least loaded.  The key is recorded for the chosen worker either way.

The key is the request's expanded prompt with each media item keyed by its content hash
(:mod:`mmgate.pipeline.routing_key`): a follow-up about the same image matches through the image; a different
image behind the same text parts at its first position.  Every ``--eviction-interval`` seconds each worker's
share of the tree is trimmed to ``--max-tree-size`` values, least recently used first.  SMG's token-usage
thresholds (``--balance-token-usage-threshold``, off by default) are not mirrored.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmgate.engines.loads import KvBatch
from mmgate.routing.policies.base import RouteRequest, RoutingPolicy, W, least_loaded
from mmgate.routing.policies.kv_index import WorkerKvIndex
from mmgate.routing.policies.tree import PAGE_SIZE, ApproxTree

#: SMG ``smg launch`` defaults (model_gateway/src/main.rs)
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
EVICTION_INTERVAL_S = 120.0
MAX_TREE_SIZE = 67108864


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

    def imbalanced(self, workers: Sequence[W]) -> bool:
        """SMG ``is_imbalanced`` on the requests in flight."""
        loads = [w.in_flight for w in workers]
        low, high = min(loads), max(loads)
        return high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold

    def select(self, workers: Sequence[W], request: RouteRequest) -> W:
        chosen = self._choose(workers, request)
        self.processed[chosen.url] = self.processed.get(chosen.url, 0) + 1
        return chosen

    def _choose(self, workers: Sequence[W], request: RouteRequest) -> W:
        fallback = least_loaded(workers, self.processed)
        values = request.key.values
        if self.imbalanced(workers):
            self.tree.insert(values, fallback.url)
            return fallback
        followed = [w for w in workers if w.url in self.kv and self.kv[w.url].held]
        if followed:
            scores = {w.url: self.kv[w.url].matched(request.key) for w in followed}
            best = max(followed, key=lambda w: (scores[w.url], -w.in_flight))
            return best if scores[best.url] > 0 else fallback
        matched = self.tree.match(values, {w.url for w in workers})
        chosen = fallback
        if matched and values:
            best = max((w for w in workers if w.url in matched), key=lambda w: (matched[w.url], -w.in_flight))
            if matched[best.url] / len(values) > self.cache_threshold:
                chosen = best
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
