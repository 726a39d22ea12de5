"""``round_robin``: the candidates in turn (SMG ``model_gateway/src/policies/round_robin.rs``: one counter,
``count % len(healthy)``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from mmgate.routing.policies.base import RouteRequest, RoutingPolicy, W


class RoundRobinPolicy(RoutingPolicy):
    """Request ``n`` (from 0) goes to candidate ``n % len(candidates)``."""

    name = "round_robin"

    def __init__(self) -> None:
        super().__init__()
        self._counter = itertools.count()

    def select(self, workers: Sequence[W], request: RouteRequest) -> W:
        return workers[next(self._counter) % len(workers)]
