"""Helpers of the Gemma 3 parity tests and ``scripts/gen_golden.py`` (no transformers, no torch).

The conversation builders and the fingerprint hashes are ``parity_support``'s; here only what is
Gemma 3's own:

* :func:`substitute_anchors`: the text-level prompt update, done the way
  ``Gemma3Processor`` (``ProcessorMixin.get_text_with_replacements``) does it: the k-th
  ``<start_of_image>`` of the rendered prompt becomes the k-th replacement text;
* :func:`replacement_ranges`: the placeholder ranges a :class:`~mmgate.types.Replacement`
  defines over the tokenized prompt (``embed_offset`` tokens before the item's first soft token
  to ``trail`` tokens after its last);
* :func:`vllm_placeholders`: the ranges vLLM finds, a port of
  ``vllm/model_executor/models/gemma3_mm.py`` ``Gemma3MultiModalProcessor._find_mm_placeholders``
  (v0.11): merged ``"\\n\\n\\n"`` / ``"\\n\\n\\n\\n"`` tokens are split into ``\\n + \\n\\n`` /
  ``\\n\\n + \\n\\n``, each item's whole replacement (tokenized alone) is searched in prompt
  order, and its start is mapped back to the merged token; the length is the replacement's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from parity_support import GOLDEN_DIR

GEMMA3_GOLDEN = GOLDEN_DIR / "gemma3.json"
GEMMA3_BUNDLE = "google--gemma-3-4b-it"
ANCHOR = "<start_of_image>"
#: the pan-and-scan ``mm_processor_kwargs`` of the corpus rows
PAS_ON = {"do_pan_and_scan": True}
PAS_CUSTOM = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 128, "pan_and_scan_max_num_crops": 6,
              "pan_and_scan_min_ratio_to_activate": 1.0}


def options_tuple(options: dict) -> tuple[tuple[str, object], ...]:
    """``mm_processor_kwargs`` as :class:`~mmgate.types.ItemHints` ``options`` (sorted pairs)."""
    return tuple(sorted(options.items()))


def substitute_anchors(prompt: str, texts: Sequence[str], anchor: str = ANCHOR) -> str:
    """``prompt`` with its k-th ``anchor`` replaced by ``texts[k]`` (replacement texts are not searched
    again, as ``re.finditer`` over the original prompt in ``get_text_with_replacements``).

    Example: ``substitute_anchors("a<A>b<A>", ["1", "<A>2"], "<A>") == "a1b<A>2"``.
    """
    pieces = prompt.split(anchor)
    assert len(pieces) == len(texts) + 1, f"{len(pieces) - 1} anchors for {len(texts)} items"
    return pieces[0] + "".join(t + p for t, p in zip(texts, pieces[1:]))


def replacement_ranges(ids: Sequence[int], embed_id: int,
                       updates: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` per item from ``(embed_offset, embed_length, trail)`` of its text-level
    :class:`~mmgate.types.Replacement`: items take their ``embed_length`` soft tokens in order."""
    positions = [i for i, t in enumerate(ids) if t == embed_id]
    assert len(positions) == sum(n for _, n, _ in updates), "soft token count differs from the plans"
    out, k = [], 0
    for offset, length, trail in updates:
        first, last = positions[k], positions[k + length - 1]
        k += length
        out.append((first - offset, last + trail - (first - offset) + 1))
    return out


def vllm_placeholders(ids: Sequence[int], replacements: Sequence[Sequence[int]],
                      newlines: tuple[int, int, int, int]) -> list[tuple[int, int]] | None:
    """vLLM's ``(offset, length)`` per item (module docstring), or None where vLLM finds none
    (a newline run its splitting does not cover, e.g. a five-newline token: vLLM then fails)."""
    n1, n2, n3, n4 = newlines
    split: list[int] = []
    origin: list[int] = []
    for i, tok in enumerate(ids):
        parts = [n1, n2] if tok == n3 else [n2, n2] if tok == n4 else [tok]
        split += parts
        origin += [i] * len(parts)
    out: list[tuple[int, int]] = []
    start = 0
    for rep in replacements:
        rep = list(rep)
        found = next((j for j in range(start, len(split) - len(rep) + 1) if split[j:j + len(rep)] == rep), None)
        if found is None:
            return None
        out.append((origin[found], len(rep)))
        start = found + len(rep)
    return out


def probe(pixel_values: np.ndarray) -> list[float]:
    """A few values of ``pixel_values`` ``[n, 3, H, W]`` (first and last image, centre, all channels):
    a golden mismatch then shows its size, not only a different hash."""
    n, _, h, w = pixel_values.shape
    picks = [pixel_values[0, :, h // 2, w // 2], pixel_values[n - 1, :, h // 3, w - 1 - w // 3]]
    return [float(v) for p in picks for v in p]
