"""A worker's load (``GetLoads``) and its KV-cache events (``SubscribeKvEvents``), engine-neutral.

Stage: select worker.  In: the ``GetLoadsResponse`` of any wire (``vllm_engine.proto``,
``sglang_scheduler.proto``, ``tokenspeed_scheduler.proto`` of smg-grpc-proto: one ``SchedulerLoad`` per DP
rank with the same core fields) and the ``KvEventBatch`` stream of ``common.proto``; out: a
:class:`WorkerLoad` and :class:`KvBatch` values the routing policies read (:mod:`mmgate.routing.policies`).
Proto types stay here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load summed over its DP ranks.

    ``token_usage``: KV-cache utilization in [0, 1] (the ranks' mean; TokenSpeed's ``active_token_usage``
    when it sends one, as SMG's ``effective_token_usage``); ``gen_throughput``: tokens/s, summed;
    ``waiting_uncached_tokens``: queued prompt tokens not served from the prefix cache, summed.
    """

    running: int = 0
    waiting: int = 0
    waiting_uncached_tokens: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0


def load_from_response(response: Any) -> WorkerLoad:
    """A ``GetLoadsResponse`` (any wire) -> :class:`WorkerLoad`."""
    ranks: Sequence[Any] = list(response.loads)
    if not ranks:
        return WorkerLoad()
    usages = []
    for rank in ranks:
        active = "active_token_usage" in rank.DESCRIPTOR.fields_by_name and rank.HasField("active_token_usage")
        usages.append(float(rank.active_token_usage if active else rank.token_usage))
    return WorkerLoad(running=sum(r.num_running_reqs for r in ranks), waiting=sum(r.num_waiting_reqs for r in ranks),
                      waiting_uncached_tokens=sum(r.num_waiting_uncached_tokens for r in ranks),
                      token_usage=sum(usages) / len(usages),
                      gen_throughput=sum(float(r.gen_throughput) for r in ranks))


@dataclass(frozen=True, slots=True)
class KvBlock:
    """One stored KV block: the engine's hash of it, its token ids, and the media items it covers as
    ``(identifier, offset)`` (``KvMultimodalKey``: the item's hash and its first position relative to the
    block's first position)."""

    block_hash: int
    token_ids: tuple[int, ...]
    media: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class KvStored:
    """Blocks stored after ``parent`` (None: at the root), in order, each the child of the one before."""

    blocks: tuple[KvBlock, ...]
    parent: int | None = None


@dataclass(frozen=True, slots=True)
class KvRemoved:
    """Blocks the engine evicted."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KvCleared:
    """Every block of the worker dropped (also the start of a relay snapshot)."""


KvEvent = KvStored | KvRemoved | KvCleared


@dataclass(frozen=True, slots=True)
class KvBatch:
    """One ``KvEventBatch``: its sequence number and its events, in order (only device-local blocks:
    remote or host-tier ones describe no worker's device cache)."""

    sequence: int
    events: tuple[KvEvent, ...]


def batch_from_proto(batch: Any) -> KvBatch:
    """A ``common.proto`` ``KvEventBatch`` -> :class:`KvBatch`."""
    from smg_grpc_proto.generated import common_pb2

    events: list[KvEvent] = []
    for event in batch.events:
        kind = event.WhichOneof("data")
        if kind == "stored":
            stored = event.stored
            if stored.HasField("locality") and stored.locality == common_pb2.KV_CACHE_LOCALITY_REMOTE:
                continue
            if stored.HasField("tier") and stored.tier not in (common_pb2.KV_CACHE_TIER_UNSPECIFIED,
                                                               common_pb2.KV_CACHE_TIER_DEVICE):
                continue
            blocks = tuple(KvBlock(b.block_hash, tuple(b.token_ids), tuple(
                (k.multimodal.identifier, k.multimodal.offset) for k in b.extra_keys
                if k.WhichOneof("key") == "multimodal")) for b in stored.blocks)
            parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
            events.append(KvStored(blocks, parent))
        elif kind == "removed":
            removed = event.removed
            if removed.HasField("tier") and removed.tier not in (common_pb2.KV_CACHE_TIER_UNSPECIFIED,
                                                                 common_pb2.KV_CACHE_TIER_DEVICE):
                continue
            events.append(KvRemoved(tuple(removed.block_hashes)))
        elif kind == "cleared":
            events.append(KvCleared())
    return KvBatch(batch.sequence_number, tuple(events))
