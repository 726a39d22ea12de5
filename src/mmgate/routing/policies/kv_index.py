"""What each worker's KV cache holds, as its ``SubscribeKvEvents`` stream says (event-driven ``cache_aware``).

Mirrors SMG's ``PositionalIndexer`` (lightseekorg/smg ``crates/kv_index/src/event_tree.rs``): a request's
prompt is cut into the worker's blocks, each block given a content hash, and a worker scores the number of
leading blocks it holds.  Here the hash is chained (a block's hash covers every block before it, as the
engines' own block hashes do), and a block's content is its token ids *plus the media items it covers* as
``(item hash, offset)`` pairs (``KvBlock.extra_keys`` ``KvMultimodalKey``: the item's first position relative to
the block's first position), so two images behind the same placeholder tokens never share a block, where SMG's
content hash covers the token ids only.  The request side computes the same from its routing key
(:class:`~mmgate.pipeline.routing_key.RoutingKey` ``tokens`` and ``items``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import blake3

from mmgate.engines.loads import KvBatch, KvCleared, KvRemoved, KvStored
from mmgate.pipeline.routing_key import RoutingKey

_ROOT = b""


def block_hash(parent: bytes, token_ids: Sequence[int], media: Sequence[tuple[str, int]]) -> bytes:
    """The chained content hash of one block after ``parent`` (``b""``: the first block)."""
    h = blake3.blake3(parent)
    h.update(b"".join(int(t).to_bytes(4, "little") for t in token_ids))
    for identifier, offset in sorted(media):
        h.update(f"|{identifier}@{offset}".encode())
    return h.digest()[:16]


def request_blocks(key: RoutingKey, block_size: int) -> list[bytes]:
    """The chained hashes of ``key``'s whole blocks of ``block_size`` tokens."""
    out: list[bytes] = []
    parent = _ROOT
    for start in range(0, len(key.tokens) // block_size * block_size, block_size):
        end = start + block_size
        media = [(it.item_hash, it.start - start) for it in key.items
                 if it.start < end and it.start + it.length > start]
        parent = block_hash(parent, key.tokens[start:end], media)
        out.append(parent)
    return out


class WorkerKvIndex:
    """One worker's live blocks, from its event stream."""

    def __init__(self) -> None:
        self.blocks: dict[int, bytes] = {}  # engine block hash -> our chained hash
        self.held: Counter[bytes] = Counter()  # chained hash -> live copies
        self.block_size = 0  # tokens per block, from the events (0: none seen yet)

    def apply(self, batch: KvBatch) -> None:
        """Apply one batch's events, in order.  A store after a parent block this index never saw is skipped
        (the worker is then partially known)."""
        for event in batch.events:
            if isinstance(event, KvCleared):
                self.blocks.clear()
                self.held.clear()
            elif isinstance(event, KvRemoved):
                for engine_hash in event.block_hashes:
                    ours = self.blocks.pop(engine_hash, None)
                    if ours is not None:
                        self.held[ours] -= 1
                        if self.held[ours] <= 0:
                            del self.held[ours]
            elif isinstance(event, KvStored):
                parent = _ROOT if event.parent is None else self.blocks.get(event.parent)
                if parent is None:
                    continue
                for block in event.blocks:
                    self.block_size = self.block_size or len(block.token_ids)
                    parent = block_hash(parent, block.token_ids, block.media)
                    if block.block_hash not in self.blocks:
                        self.blocks[block.block_hash] = parent
                        self.held[parent] += 1

    def matched(self, key: RoutingKey) -> int:
        """How many leading whole blocks of ``key`` this worker holds."""
        if not self.block_size:
            return 0
        count = 0
        for h in request_blocks(key, self.block_size):
            if h not in self.held:
                break
            count += 1
        return count
