"""``power_of_two``: two random candidates, the less loaded one (SMG
``model_gateway/src/policies/power_of_two.rs``).

The load compared is each worker's KV-cache usage from ``GetLoads`` when both have an answer, else (either
lacks one) both workers' requests in flight, as SMG degrades both to request counts; a tie goes to the first
drawn.
"""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from mmgate.routing.policies.base import RouteRequest, RoutingPolicy, W


class PowerOfTwoPolicy(RoutingPolicy):
    """See the module docstring; ``rng`` draws the pair (for tests)."""

    name = "power_of_two"
    wants_loads = True

    def __init__(self, rng: _random.Random | None = None) -> None:
        super().__init__()
        self.rng = rng or _random.SystemRandom()

    def select(self, workers: Sequence[W], request: RouteRequest) -> W:
        if len(workers) == 1:
            return workers[0]
        i = self.rng.randrange(len(workers))
        j = (i + 1 + self.rng.randrange(len(workers) - 1)) % len(workers)
        return self.pick(workers[i], workers[j])

    def pick(self, first: W, second: W) -> W:
        """The less loaded of a drawn pair (ties: ``first``)."""
        a, b = self.loads.get(first.url), self.loads.get(second.url)
        if a is not None and b is not None:
            return first if a.token_usage <= b.token_usage else second
        return first if first.in_flight <= second.in_flight else second
