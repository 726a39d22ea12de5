"""The approximate radix tree of ``cache_aware``: which prefixes of routing keys were sent to which worker.

Mirrors SMG's ``TokenTree`` (lightseekorg/smg ``crates/kv_index/src/token_tree.rs``): one tree shared by the
workers (its *tenants*), keyed by pages of ``page_size`` values (only whole pages are kept, as an engine caches
whole blocks), each node holding the tenants that were sent its path with their last access; a tenant's size
is its pages times ``page_size``; :meth:`ApproxTree.evict` trims each tenant to a size, least recently used
leaves first (SMG ``evict_tenant_by_size``).  SMG's gRPC tree works on token ids and its HTTP one on text; this
one works on routing-key values (:mod:`mmgate.pipeline.routing_key`: token ids, with each media item's run keyed
by its content hash).  Where SMG reports "any tenant" of the deepest matching node, :meth:`ApproxTree.match`
reports every tenant's own match length, so the policy can prefer the best-matching worker among the healthy
ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

PAGE_SIZE = 16  # SMG kv_index PAGE_SIZE (SGLang's radix-cache page), --block-size


@dataclass(eq=False, slots=True)
class _Node:
    page: tuple[int, ...]
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    tenants: dict[str, int] = field(default_factory=dict)  # tenant -> last access (a logical clock)


class ApproxTree:
    """See the module docstring.  Not thread-safe: used on the gateway's event loop."""

    def __init__(self, page_size: int = PAGE_SIZE) -> None:
        if page_size < 1:
            raise ValueError("page size must be at least 1")
        self.page_size = page_size
        self.root = _Node((), None)
        self.sizes: dict[str, int] = {}  # tenant -> values held (pages x page_size)
        self._clock = itertools.count(1)

    def _pages(self, values: Sequence[int]) -> list[tuple[int, ...]]:
        n = len(values) // self.page_size * self.page_size
        return [tuple(values[i:i + self.page_size]) for i in range(0, n, self.page_size)]

    def match(self, values: Sequence[int], tenants: Collection[str] | None = None) -> dict[str, int]:
        """Per tenant (of ``tenants``, or all): how many leading values of ``values`` it was sent (whole pages).
        Touches nothing."""
        matched: dict[str, int] = {}
        node = self.root
        depth = 0
        for page in self._pages(values):
            child = node.children.get(page)
            if child is None:
                break
            depth += self.page_size
            for tenant in child.tenants:
                if tenants is None or tenant in tenants:
                    matched[tenant] = depth
            node = child
        return matched

    def insert(self, values: Sequence[int], tenant: str) -> None:
        """Record that ``values`` (its whole pages) were sent to ``tenant``; touches its path."""
        now = next(self._clock)
        self.sizes.setdefault(tenant, 0)
        node = self.root
        for page in self._pages(values):
            child = node.children.get(page)
            if child is None:
                child = node.children[page] = _Node(page, node)
            if tenant not in child.tenants:
                self.sizes[tenant] += self.page_size
            child.tenants[tenant] = now
            node = child

    def _drop(self, node: _Node, tenant: str) -> None:
        del node.tenants[tenant]
        self.sizes[tenant] -= self.page_size
        while node.parent is not None and not node.tenants and not node.children:
            del node.parent.children[node.page]
            node = node.parent

    def evict(self, max_size: int) -> None:
        """Trim every tenant to at most ``max_size`` values, its least recently used leaves first."""
        for tenant, size in list(self.sizes.items()):
            if size <= max_size:
                continue
            heap: list[tuple[int, int, _Node]] = []
            stack = [self.root]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if tenant in node.tenants and not any(tenant in c.tenants for c in node.children.values()):
                    heapq.heappush(heap, (node.tenants[tenant], id(node), node))
            while self.sizes[tenant] > max_size and heap:
                _, _, node = heapq.heappop(heap)
                parent = node.parent
                self._drop(node, tenant)
                if (parent is not None and parent is not self.root and tenant in parent.tenants
                        and not any(tenant in c.tenants for c in parent.children.values())):
                    heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))

    def remove_tenant(self, tenant: str) -> None:
        """Forget ``tenant`` everywhere."""
        stack = [self.root]
        found: list[_Node] = []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if tenant in node.tenants:
                found.append(node)
        for node in reversed(found):  # deepest last found first: children before parents
            if tenant in node.tenants:
                self._drop(node, tenant)
        self.sizes.pop(tenant, None)
