"""Routing policies: one module per policy behind :class:`~mmgate.routing.policies.base.RoutingPolicy`,
chosen once from the settings (``--policy``, ``--prefill-policy``, ``--decode-policy``; docs/routing.md).

Stage: select worker.  :func:`make_policy` builds a policy by name; :func:`policies_for` the one per role.
The names and defaults are the Rust gateway's (smg 1.13.0; lightseekorg/smg ``model_gateway/src/policies/``).
"""

from __future__ import annotations

from mmgate.config.settings import RoutingSettings
from mmgate.engines.base import Role
from mmgate.routing.policies.base import RouteRequest, RoutingPolicy
from mmgate.routing.policies.cache_aware import CacheAwarePolicy
from mmgate.routing.policies.consistent_hashing import ConsistentHashingPolicy
from mmgate.routing.policies.least_load import LeastLoadPolicy
from mmgate.routing.policies.power_of_two import PowerOfTwoPolicy
from mmgate.routing.policies.prefix_hash import PrefixHashPolicy
from mmgate.routing.policies.random import RandomPolicy
from mmgate.routing.policies.round_robin import RoundRobinPolicy

__all__ = ["RouteRequest", "RoutingPolicy", "make_policy", "policies_for"]


def make_policy(name: str, routing: RoutingSettings) -> RoutingPolicy:
    """The policy called ``name`` with ``routing``'s knobs.

    Raises:
        ValueError: an unknown name.
    """
    if name == "random":
        return RandomPolicy()
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy(routing.least_load_kv_pressure_weight, routing.least_load_default_throughput,
                               routing.least_load_mean_prefill_tokens, routing.least_load_max_waiting_requests)
    if name == "power_of_two":
        return PowerOfTwoPolicy()
    if name == "consistent_hashing":
        return ConsistentHashingPolicy()
    if name == "prefix_hash":
        return PrefixHashPolicy(routing.prefix_token_count, routing.prefix_hash_load_factor,
                                routing.prefix_hash_balance_abs_threshold)
    if name == "cache_aware":
        return CacheAwarePolicy(routing.cache_threshold, routing.balance_abs_threshold, routing.balance_rel_threshold,
                                routing.max_tree_size, routing.block_size)
    raise ValueError(f"unknown routing policy {name!r}")


def policies_for(routing: RoutingSettings) -> dict[Role, RoutingPolicy]:
    """One policy per role: single workers ``--policy``, the PD legs ``--prefill-policy`` /
    ``--decode-policy`` (each its own instance and state, as SMG's per-leg policies)."""
    return {Role.SINGLE: make_policy(routing.policy, routing),
            Role.PREFILL: make_policy(routing.prefill_policy or routing.policy, routing),
            Role.DECODE: make_policy(routing.decode_policy or routing.policy, routing)}
