"""``random``: a uniformly random worker (SMG ``model_gateway/src/policies/random.rs``)."""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from mmgate.routing.policies.base import RouteRequest, RoutingPolicy, W


class RandomPolicy(RoutingPolicy):
    """Each request to a worker drawn uniformly from the candidates (``rng``: the source, for tests)."""

    name = "random"

    def __init__(self, rng: _random.Random | None = None) -> None:
        super().__init__()
        self.rng = rng or _random.SystemRandom()

    def select(self, workers: Sequence[W], request: RouteRequest) -> W:
        return workers[self.rng.randrange(len(workers))]
