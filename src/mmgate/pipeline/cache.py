"""Pixel cache: a byte-bounded LRU of preprocessed items (``--mm-pixel-cache-mb``).

Key: the item hash, i.e. blake3 of the original bytes' content hash plus the
family fingerprint (model and its full preprocessing config) and the output
form (float32 or raw uint8).  Value: the item's rows of ``pixel_values``
(read-only arrays, shared by every request that hits them).  Each image of a
multi-image request is cached on its own.  Confined to the event loop thread
(no locking).

One cache serves every model of the gateway (issue 25).  Keys of two models
never collide unless their rows are the same: the fingerprint names the family,
``model_type``, image backend and every preprocessing parameter, so two models
that preprocess alike (one family and config, e.g. two sizes of Qwen2.5-VL)
share an entry, which holds the same rows for both, and any difference in
preprocessing keys apart.  Hits and misses are counted under the model of the
request (``mmgate_mm_pixel_cache_{hits,misses}_total{model,modality}``).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from mmgate.observe import metrics


class PixelCache:
    """LRU bounded by the total ``nbytes`` of its arrays."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[str, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str, model: str, modality: str = "image") -> np.ndarray | None:
        """The rows cached under ``key`` (now the most recently used), else None; counted as a hit or miss
        of ``model`` (the served name of the request asking)."""
        rows = self._items.get(key)
        if rows is None:
            metrics.CACHE_MISSES.labels(model, modality).inc()
            return None
        self._items.move_to_end(key)
        metrics.CACHE_HITS.labels(model, modality).inc()
        return rows

    def put(self, key: str, rows: np.ndarray) -> None:
        """Insert (an item larger than the whole cache is not kept)."""
        if rows.nbytes > self.max_bytes or key in self._items:
            return
        rows.setflags(write=False)
        self._items[key] = rows
        self.nbytes += rows.nbytes
        while self.nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes
        metrics.CACHE_BYTES.set(self.nbytes)
