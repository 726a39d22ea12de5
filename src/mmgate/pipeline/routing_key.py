"""The routing key of a request: its expanded prompt with every media item keyed by its content hash.

Stage: between planning and preprocessing (:meth:`mmgate.pipeline.prepare.Pipeline.process_media` builds it
before it calls ``choose_worker``), and in worker mode (:mod:`mmgate.routing.media_refs`).  In: the prompt ids
with one anchor per item, and per item its hash and the length of the placeholder run it expands to; out: a
:class:`RoutingKey` the routing policies (:mod:`mmgate.routing.policies`) read.

The key rule for media (docs/routing.md, "The tree's key"): the run an item's anchor expands to is replaced,
position by position, by values derived from the item's hash (:func:`media_value`), all at or above
:data:`MEDIA_BASE`, above every token id.  Two requests about the same image (same bytes, same processor
hints) share the branch up to and through the image; a different image behind the same text parts at its
first position, as the vLLM decode leg's KV blocks part (vLLM ``v1/core/kv_cache_utils.py``
``generate_block_hash_extra_keys`` folds each item's ``mm_hash`` into the blocks it covers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: every media position of a key is at or above this value (token ids are below 2**31)
MEDIA_BASE = 1 << 32
_MEDIA_SPAN = 1 << 62


def media_value(item: str, index: int) -> int:
    """The key value of position ``index`` (0-based) of the run of the item whose hash is ``item``
    (hex, any length; its first 15 digits are used)."""
    return MEDIA_BASE + (int(item[:15] or "0", 16) + index) % _MEDIA_SPAN


@dataclass(frozen=True, slots=True)
class KeyItem:
    """One media item of a key: its hash and where its run sits in :attr:`RoutingKey.tokens`."""

    item_hash: str
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """What a routing policy may read of a request.

    ``tokens``: the prompt as the engine will see it where that is known before preprocessing (a family whose
    prompt updates are token-level), else with each item's run as a repeat of its anchor id (text-level
    updates, worker mode: one anchor per item); ``items``: the media runs in ``tokens``, in prompt order.
    :attr:`values` is the key the policies match on.
    """

    tokens: tuple[int, ...]
    items: tuple[KeyItem, ...] = ()

    @property
    def values(self) -> tuple[int, ...]:
        """``tokens`` with every position of an item's run replaced by :func:`media_value`."""
        if not self.items:
            return self.tokens
        out = list(self.tokens)
        for item in self.items:
            for j in range(item.length):
                out[item.start + j] = media_value(item.item_hash, j)
        return tuple(out)

    @classmethod
    def text(cls, ids: Sequence[int]) -> RoutingKey:
        """The key of a prompt without media."""
        return cls(tuple(ids))


EMPTY_KEY = RoutingKey(())


def expanded_key(ids: Sequence[int], runs: Mapping[int, Sequence[tuple[str, Sequence[int] | int]]]) -> RoutingKey:
    """The key of a prompt with one anchor per item.

    ``runs``: anchor token id -> per item of that anchor, in prompt order, ``(item hash, run)`` where ``run``
    is the ids the anchor expands to, or their count when they are not known before preprocessing (each is
    then the anchor id).  Anchors beyond the listed items stay as they are.
    """
    tokens: list[int] = []
    items: list[KeyItem] = []
    seen = {anchor: 0 for anchor in runs}
    for token in ids:
        todo = runs.get(token)
        if todo is None or seen[token] >= len(todo):
            tokens.append(token)
            continue
        item_hash, run = todo[seen[token]]
        seen[token] += 1
        run_ids = [token] * run if isinstance(run, int) else list(run)
        items.append(KeyItem(item_hash, len(tokens), len(run_ids)))
        tokens.extend(run_ids)
    return RoutingKey(tuple(tokens), tuple(items))
