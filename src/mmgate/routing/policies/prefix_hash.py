"""``prefix_hash``: the first ``--prefix-token-count`` values of the routing key hashed onto the
consistent-hash ring, with a load bound (smg 1.13 ``prefix_hash``).

With ``mean = (total + 1) / n`` (the candidates' requests in flight, counting the incoming one), the ring's
worker is taken unless it is overloaded: its requests in flight exceed both ``mean x load_factor``
(``--prefix-hash-load-factor``) AND ``mean + abs`` (``--prefix-hash-balance-abs-threshold``).  An overloaded
ring worker gives way to the least loaded worker that is not overloaded, else (all are) the ring's worker
anyway.  An empty key: the least loaded worker.  Mirrors lightseekorg/smg
``model_gateway/src/policies/prefix_hash.rs`` as stored in the search index (a post-1.10 revision whose
``load_ok`` is ``load <= max(mean * load_factor, mean + balance_abs_threshold)``, default 10, the flag and
default smg 1.13.0's ``smg launch --help`` lists); smg's ``--cache-boundaries`` hashing depths are not
mirrored.  The prefix is the routing key (media keyed by content hash, :mod:`mmgate.pipeline.routing_key`),
each value as 8 little-endian bytes, hashed with blake3 where SMG hashes the u32 token ids with xxh3.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3

from mmgate.routing.policies.base import RouteRequest, RoutingPolicy, W, least_loaded
from mmgate.routing.policies.ring import ring_lookup

PREFIX_TOKEN_COUNT = 256  # smg --prefix-token-count
LOAD_FACTOR = 1.25  # smg --prefix-hash-load-factor
BALANCE_ABS_THRESHOLD = 10  # smg --prefix-hash-balance-abs-threshold


def prefix_digest(values: Sequence[int], count: int) -> str:
    """The ring key of a prefix: 16 hex digits of blake3 over its first ``count`` values."""
    data = b"".join(v.to_bytes(8, "little") for v in values[:count])
    return blake3.blake3(data).hexdigest()[:16]


class PrefixHashPolicy(RoutingPolicy):
    """See the module docstring."""

    name = "prefix_hash"

    def __init__(self, prefix_token_count: int = PREFIX_TOKEN_COUNT, load_factor: float = LOAD_FACTOR,
                 balance_abs_threshold: int = BALANCE_ABS_THRESHOLD) -> None:
        super().__init__()
        self.prefix_token_count = prefix_token_count
        self.load_factor = load_factor
        self.balance_abs_threshold = balance_abs_threshold

    def _load_ok(self, load: int, total: int, n: int) -> bool:
        """smg ``load_ok``: not past both the relative and the absolute bound over the mean."""
        if total == 0:
            return True
        mean = (total + 1) / n
        return load <= max(mean * self.load_factor, mean + self.balance_abs_threshold)

    def select(self, workers: Sequence[W], request: RouteRequest) -> W:
        values = request.key.values
        if not values:
            return least_loaded(workers)
        url = ring_lookup([w.url for w in workers], prefix_digest(values, self.prefix_token_count))
        chosen = next(w for w in workers if w.url == url)
        total = sum(w.in_flight for w in workers)
        if self._load_ok(chosen.in_flight, total, len(workers)):
            return chosen
        fitting = [w for w in workers if self._load_ok(w.in_flight, total, len(workers))]
        return min(fitting, key=lambda w: w.in_flight) if fitting else chosen
