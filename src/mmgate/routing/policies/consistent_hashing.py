"""``consistent_hashing``: session affinity by a key on a consistent-hash ring (SMG
``model_gateway/src/policies/consistent_hashing.rs``).

Priority, as SMG: the ``X-SMG-Target-Worker`` header (a 0-based index into the candidates; out of range: no
worker, 503), then ``X-SMG-Routing-Key``, then the first of the ``Authorization``, ``X-Forwarded-For`` and
``Cookie`` headers, hashed on the ring (:mod:`mmgate.routing.policies.ring`).  mmgate adds the request's
OpenAI ``user`` field after the headers; a request with none of them goes to a random worker.
"""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from mmgate.errors import ErrorCode, GatewayError
from mmgate.routing.policies.base import RouteRequest, RoutingPolicy, W
from mmgate.routing.policies.ring import ring_lookup


class ConsistentHashingPolicy(RoutingPolicy):
    """See the module docstring."""

    name = "consistent_hashing"

    def __init__(self, rng: _random.Random | None = None) -> None:
        super().__init__()
        self.rng = rng or _random.SystemRandom()

    def select(self, workers: Sequence[W], request: RouteRequest) -> W:
        """Raises:
            GatewayError(NO_HEALTHY_WORKER): ``X-SMG-Target-Worker`` names no candidate.
        """
        headers = request.headers
        target = headers.get("x-smg-target-worker")
        if target is not None:
            if target.isdigit() and int(target) < len(workers):
                return workers[int(target)]
            raise GatewayError(ErrorCode.NO_HEALTHY_WORKER, "X-SMG-Target-Worker names no healthy worker")
        key = (headers.get("x-smg-routing-key") or headers.get("authorization") or headers.get("x-forwarded-for")
               or headers.get("cookie") or request.user)
        if key:
            url = ring_lookup([w.url for w in workers], key)
            return next(w for w in workers if w.url == url)
        return workers[self.rng.randrange(len(workers))]
