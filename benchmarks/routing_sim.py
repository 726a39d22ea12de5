"""The routing benchmark's model of a worker's prefix cache, its trace and its oracle (no I/O, no gateway).

* :func:`block_keys`: the chained keys of a prompt's full blocks, as vLLM's prefix cache keys them
  (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens`` / ``generate_block_hash_extra_keys``,
  vLLM 0.11): block ``i`` covers tokens ``[i*B, (i+1)*B)``; its key hashes the parent block's key,
  the block's token ids, and the content key of every media item whose placeholder range overlaps
  the block.  Two different images behind the same text, whose placeholder tokens are the same
  ids, therefore never share a block.
* :class:`PrefixCache`: an LRU over those keys with a fixed capacity in blocks.  A request is served
  from the longest run of leading cached blocks (at most ``(n - 1) // B`` of them: vLLM always
  computes the last prompt token, ``max_cache_hit_length = num_tokens - 1``); then every full block
  is admitted, touched last-block-first so that, as vLLM frees a request's blocks tail first, a
  prompt's tail is evicted before its head.
* :func:`make_trace`: a seeded multi-turn trace of image and video conversations.
* :func:`oracle`: routes each prompt to the worker with the longest cached prefix (it sees every
  cache) under a bound on the request-count spread; an upper reference for a cache-aware policy.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

BLOCK_TOKENS = 16


def block_keys(ids: Sequence[int], items: Sequence[tuple[int, int, str]], block: int = BLOCK_TOKENS) -> list[int]:
    """Keys (64-bit ints) of the full blocks of prompt ``ids``.

    Args:
        ids: the expanded prompt token ids.
        items: ``(offset, length, content_key)`` of each media item's placeholder range in ``ids``.
        block: tokens per block.

    Returns:
        ``len(ids) // block`` keys; key ``i`` depends on every token and media item of blocks ``0..i``.
    """
    keys: list[int] = []
    parent = b""
    ordered = sorted(items)
    for b in range(len(ids) // block):
        start, end = b * block, (b + 1) * block
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(struct.pack(f"<{block}I", *ids[start:end]))
        for off, length, key in ordered:
            if off < end and off + length > start:
                h.update(key.encode())
        parent = h.digest()
        keys.append(int.from_bytes(parent, "little"))
    return keys


class PrefixCache:
    """An LRU of block keys holding at most ``capacity`` blocks (see the module docstring)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least one block")
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, keys: Sequence[int], prompt_tokens: int, block: int = BLOCK_TOKENS) -> int:
        """Leading cached blocks of ``keys`` that may serve a prompt of ``prompt_tokens`` tokens."""
        limit = min(len(keys), max(0, prompt_tokens - 1) // block)
        n = 0
        while n < limit and keys[n] in self._lru:
            n += 1
        return n

    def admit(self, keys: Sequence[int]) -> None:
        """Insert or refresh ``keys`` (tail first, so the head is the most recent); evict the least recent."""
        for k in reversed(keys):
            self._lru[k] = None
            self._lru.move_to_end(k)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def serve(self, keys: Sequence[int], prompt_tokens: int, block: int = BLOCK_TOKENS) -> int:
        """Tokens of the prompt served from the cache; then the prompt's blocks are admitted."""
        hit = self.match(keys, prompt_tokens, block)
        self.admit(keys)
        return hit * block

    def clear(self) -> None:
        self._lru.clear()


# ---------------------------------------------------------------- the trace


@dataclass(frozen=True)
class Media:
    """One media item of the trace: ``kind`` "image" or "video", a name, its pixel size and a seed."""

    kind: str
    name: str
    width: int
    height: int
    seed: int


@dataclass
class Conversation:
    """One user's conversation: a system prompt, media in the first user turn, then follow-ups."""

    user: str
    system: str
    media: list[Media]
    questions: list[str]  # one per turn
    answers: list[str]  # the assistant's answer to each turn but the last (the trace's, not the worker's)

    def messages(self, turn: int, media_parts: list[dict[str, object]]) -> list[dict[str, object]]:
        """The chat messages of turn ``turn`` (0-based): history so far plus the new user message."""
        msgs: list[dict[str, object]] = [{"role": "system", "content": self.system}]
        for t in range(turn + 1):
            content: list[dict[str, object]] = list(media_parts) if t == 0 else []
            content.append({"type": "text", "text": self.questions[t]})
            msgs.append({"role": "user", "content": content})
            if t < turn:
                msgs.append({"role": "assistant", "content": self.answers[t]})
        return msgs


@dataclass
class Trace:
    conversations: list[Conversation] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(len(c.questions) for c in self.conversations)

    def media(self) -> list[Media]:
        """Every distinct media item, in first-use order."""
        seen: dict[str, Media] = {}
        for c in self.conversations:
            for m in c.media:
                seen.setdefault(m.name, m)
        return list(seen.values())


_WORDS = ("the picture shows a red block near the left edge and a soft gradient behind it while the lower part "
          "holds darker shapes that could be furniture or shadows cast by a window light falls from above so the "
          "colours look warm and the scene seems calm with no people visible and a small object in the corner "
          "frame moves slowly to the right as the camera stays still").split()
_QUESTIONS = ("Describe this in one sentence.", "What stands out first?", "What colour dominates?",
              "Is anything moving?", "Count the distinct shapes.", "Where is the brightest area?",
              "Summarise it for a caption.", "What could this be used for?", "Any text visible?",
              "Compare the left and right halves.")
_SYSTEM_BASE = ("You are a careful visual assistant for an image-review team. Answer briefly and precisely, "
                "describe only what is visible, say when you are unsure, never invent text that is not in the "
                "picture, and keep a neutral tone. ")


def _sentence(rng: random.Random, words: int) -> str:
    start = rng.randrange(len(_WORDS))
    return " ".join(_WORDS[(start + i) % len(_WORDS)] for i in range(words)).capitalize() + "."


def system_prompts() -> list[str]:
    """The three shared system prompts (long, medium, short)."""
    policy = " ".join(f"Rule {i}: {_WORDS[(7 * i) % len(_WORDS)]} {_WORDS[(11 * i) % len(_WORDS)]} must be "
                      f"reported with its position and size." for i in range(1, 7))
    return [_SYSTEM_BASE + policy, _SYSTEM_BASE + "Prefer lists for counts.", "You are a helpful assistant."]


def make_trace(seed: int = 25, users: int = 48, hot_images: int = 3, hot_share: float = 0.6,
               video_share: float = 0.25, two_image_share: float = 0.15, turns: tuple[int, int] = (2, 5)) -> Trace:
    """A deterministic trace: ``users`` conversations of ``turns`` (inclusive range) turns each.

    Each conversation picks a shared system prompt (long 50 %, medium 30 %, short 20 %), and media:
    a video clip (``video_share``), two images (``two_image_share``), else one image; an image is one of
    ``hot_images`` hot images shared by many users with probability ``hot_share``, else the user's own.
    Same arguments, same trace (``random.Random(seed)``; no global state).
    """
    rng = random.Random(seed)
    systems = system_prompts()
    sizes = [(896, 672), (896, 672), (672, 896), (768, 576)]  # photo-like; most share one size
    hot = [Media("image", f"hot{i}", *sizes[i % len(sizes)], seed=1000 + i) for i in range(hot_images)]
    convs: list[Conversation] = []
    for u in range(users):
        system = rng.choices(systems, weights=(5, 3, 2))[0]
        r = rng.random()
        own = [Media("image", f"u{u}-img{k}", *rng.choice(sizes), seed=seed * 10_000 + u * 10 + k) for k in range(2)]
        if r < video_share:
            media = [Media("video", f"u{u}-clip", 448, 336, seed=seed * 10_000 + u * 10 + 5)]
        elif r < video_share + two_image_share:
            media = [rng.choice(hot) if rng.random() < hot_share else own[0], own[1]]
        else:
            media = [rng.choice(hot) if rng.random() < hot_share else own[0]]
        n = rng.randint(*turns)
        questions = rng.sample(_QUESTIONS, n)
        answers = [_sentence(rng, rng.randint(12, 40)) for _ in range(n - 1)]
        convs.append(Conversation(f"user{u}", system, media, questions, answers))
    return Trace(convs)


# ---------------------------------------------------------------- the oracle


@dataclass
class OracleResult:
    prompt_tokens: int
    hit_tokens: int
    requests: list[int]  # per worker

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def spread(self) -> float:
        return load_spread(self.requests)


def load_spread(requests: Sequence[int]) -> float:
    """max / mean requests per worker (1.0 is perfectly even)."""
    total = sum(requests)
    return max(requests) / (total / len(requests)) if total else 0.0


def oracle(prompts: Sequence[tuple[int, Sequence[int]]], workers: int, capacity: int, max_spread: float,
           block: int = BLOCK_TOKENS) -> OracleResult:
    """Route each ``(prompt_tokens, block_keys)`` in order to the worker with the longest cached prefix.

    Only workers whose request count after taking it stays within ``max_spread`` times the running mean
    (rounded up) may take it; ties go to the fewest requests, then the lowest index.  Each worker is a
    :class:`PrefixCache` of ``capacity`` blocks, served exactly as the recording workers serve.
    """
    caches = [PrefixCache(capacity) for _ in range(workers)]
    counts = [0] * workers
    hits = total = 0
    for done, (n, keys) in enumerate(prompts, start=1):
        bound = done if math.isinf(max_spread) else max(1, math.ceil(max_spread * done / workers - 1e-9))
        allowed = [w for w in range(workers) if counts[w] + 1 <= bound] or list(range(workers))
        best = max(allowed, key=lambda w: (caches[w].match(keys, n, block), -counts[w], -w))
        hits += caches[best].serve(keys, n, block)
        total += n
        counts[best] += 1
    return OracleResult(total, hits, counts)
