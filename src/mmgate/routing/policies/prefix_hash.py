"""``prefix_hash``: the first ``--prefix-token-count`` values of the routing key hashed onto the
consistent-hash ring, with a load bound (SMG ``model_gateway/src/policies/prefix_hash.rs``).

The ring's worker is taken when its requests in flight are at most ``(total + 1) / n * load_factor``
(``--prefix-hash-load-factor``); otherwise the least loaded worker under that bound, else the ring's worker
anyway.  An empty key: the least loaded worker.  The prefix is the routing key (media keyed by content
hash, :mod:`mmgate.pipeline.routing_key`), each value as 8 little-endian bytes, hashed with blake3 where SMG
hashes the u32 token ids with xxh3.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3

from mmgate.routing.policies.base import RouteRequest, RoutingPolicy, W, least_loaded
from mmgate.routing.policies.ring import ring_lookup

PREFIX_TOKEN_COUNT = 256  # SMG --prefix-token-count
LOAD_FACTOR = 1.25  # SMG --prefix-hash-load-factor


def prefix_digest(values: Sequence[int], count: int) -> str:
    """The ring key of a prefix: 16 hex digits of blake3 over its first ``count`` values."""
    data = b"".join(v.to_bytes(8, "little") for v in values[:count])
    return blake3.blake3(data).hexdigest()[:16]


class PrefixHashPolicy(RoutingPolicy):
    """See the module docstring."""

    name = "prefix_hash"

    def __init__(self, prefix_token_count: int = PREFIX_TOKEN_COUNT, load_factor: float = LOAD_FACTOR) -> None:
        super().__init__()
        self.prefix_token_count = prefix_token_count
        self.load_factor = load_factor

    def _load_ok(self, load: int, total: int, n: int) -> bool:
        return total == 0 or load <= (total + 1) / n * self.load_factor

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
