"""Content hashes of media items (``mm_hashes``).

``content_hash(data)``: blake3 hex of the original encoded bytes, as the
engine wire's ``mm_hashes`` expects (vLLM ``MultiModalHasher`` hashes item
content; SMG hashes the original bytes with blake3).  ``item_hash`` mixes in
a processor fingerprint so that two models (or two preprocessing settings)
never share an encoder-cache entry for the same bytes.
"""

from __future__ import annotations

import blake3


def content_hash(data: bytes | memoryview) -> str:
    """blake3 hex digest (64 chars) of ``data``."""
    return blake3.blake3(data).hexdigest()


def item_hash(content: str, fingerprint: str) -> str:
    """blake3 hex of ``content`` hash + processor ``fingerprint`` (the cache key of one item)."""
    return blake3.blake3(f"{content}:{fingerprint}".encode()).hexdigest()
