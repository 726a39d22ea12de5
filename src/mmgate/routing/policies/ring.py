"""The consistent-hash ring of ``consistent_hashing`` and ``prefix_hash`` (SMG
``model_gateway/src/worker/hash_ring.rs``): 150 virtual nodes per worker at ``blake3(f"{url}#{i}")``'s first 8
bytes (little-endian); a key goes to the first worker at or after ``blake3(key)``'s position, clockwise."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from functools import lru_cache

import blake3

VIRTUAL_NODES_PER_WORKER = 150


def position(text: str) -> int:
    """A string's place on the ring: the first 8 bytes of its blake3 digest, little-endian."""
    return int.from_bytes(blake3.blake3(text.encode()).digest()[:8], "little")


@lru_cache(maxsize=64)
def _ring(urls: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    entries = sorted((position(f"{url}#{i}"), url) for url in urls for i in range(VIRTUAL_NODES_PER_WORKER))
    return tuple(p for p, _ in entries), tuple(u for _, u in entries)


def ring_lookup(urls: Sequence[str], key: str) -> str:
    """The URL of ``urls`` (not empty) that ``key`` lands on (the ring is built over ``urls`` themselves,
    so an unhealthy worker's keys move to the next one clockwise, as SMG's ``find_healthy_url`` walks)."""
    positions, owners = _ring(tuple(sorted(urls)))
    start = bisect.bisect_left(positions, position(key))
    return owners[start % len(owners)]
