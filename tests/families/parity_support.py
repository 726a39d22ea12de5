"""Shared helpers of the family parity tests and ``scripts/gen_golden.py``.

Nothing here imports transformers or torch: the golden tier (and the script
that writes it) regenerate the same image bytes from these functions.

* Model bundles are found on ``MMGATE_MODEL_PATH`` (an ``os.pathsep`` list of
  folders holding ``org--name`` bundle folders); default: ``<repo>/../shared/models``.
* ``synth_pixels`` / ``synth_image`` / ``encode_image`` make deterministic test
  images from a seeded numpy ``Generator`` using integer arithmetic only
  (no libm), so the same (size, mode, seed) gives the same pixels everywhere.
* ``splice_anchors`` expands a tokenized prompt the way the reference
  processor does: each anchor id becomes the ids of its ``Replacement``.
* ``chat_messages`` builds one conversation (``(role, parts)`` turns, an int part
  is an image index) in the three shapes the tiers need: OpenAI ``image_url``
  parts (``openai_messages``), ``{"type": "image", "image": PIL}`` parts for
  ``processor.apply_chat_template`` (``reference_messages``) and ``{"type": "image"}``
  parts as mmgate's planner renders them (``template_messages``).
* ``sha256_f32le`` / ``sha256_ids`` / ``collapse_runs`` / ``probe8``: the golden
  fingerprints, shared by the generator and the replay.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
QWEN_VL_GOLDEN = GOLDEN_DIR / "qwen_vl.json"

#: bundle folder names of the Qwen-VL family rows (model_type in the comment)
QWEN_VL_BUNDLES = (
    "Qwen--Qwen2-VL-2B-Instruct",  # qwen2_vl
    "Qwen--Qwen2.5-VL-7B-Instruct",  # qwen2_5_vl (no tokenizer.json: BPE from vocab.json + merges.txt)
    "Qwen--Qwen3-VL-2B-Instruct",  # qwen3_vl
)
#: bundle folder names of the Qwen Omni family's image rows (golden/qwen_omni.json)
QWEN_OMNI_BUNDLES = (
    "Qwen--Qwen2.5-Omni-7B",  # qwen2_5_omni
    "Qwen--Qwen3-Omni-30B-A3B-Instruct",  # qwen3_omni_moe
)

#: modes the corpus covers; JPEG is written for RGB and L only
MODES = ("RGB", "RGBA", "L", "LA", "P", "P+tRNS", "P+alpha")


def model_search_path() -> tuple[Path, ...]:
    """Folders holding model bundles: ``MMGATE_MODEL_PATH`` or ``<repo>/../shared/models``."""
    value = os.environ.get("MMGATE_MODEL_PATH")
    if value:
        return tuple(Path(p) for p in value.split(os.pathsep) if p)
    return ((REPO_ROOT.parent / "shared" / "models").resolve(),)


def find_bundle_dir(folder_name: str) -> Path | None:
    """The first ``<root>/<folder_name>`` with a ``config.json`` on the search path, or None."""
    for root in model_search_path():
        candidate = root / folder_name
        if (candidate / "config.json").is_file():
            return candidate
    return None


# ---------------------------------------------------------------- images


def _ramp(n: int, lo: int, hi: int) -> np.ndarray:
    """Integer linear ramp of ``n`` values from ``lo`` to ``hi`` (int32)."""
    idx = np.arange(n, dtype=np.int32)
    return (lo + (idx * (hi - lo)) // max(n - 1, 1)).astype(np.int32)


def synth_pixels(width: int, height: int, seed: int) -> np.ndarray:
    """Deterministic uint8 ``[H, W, 4]`` RGBA content: smooth gradients + blocks + noise.

    Per channel: a horizontal and a vertical integer ramp with random end points
    (smooth regions, where resampling weights matter), a coarse checkerboard of
    random period (sharp edges), and uniform noise whose amplitude varies by
    quadrant (high-frequency content, where antialiasing and clamping matter).
    Alpha is a diagonal ramp plus noise, so many levels 0..255 occur.
    Integer arithmetic only (int32, no overflow), so the result does not depend
    on the platform's floating point.
    """
    rng = np.random.default_rng(seed)
    ends = rng.integers(0, 256, size=(4, 4), dtype=np.int64)  # per channel: x_lo, x_hi, y_lo, y_hi
    period = int(rng.integers(2, 64))
    amp = rng.integers(0, 96, size=4, dtype=np.int64).astype(np.int32)  # noise amplitude per quadrant
    noise = rng.integers(0, 256, size=(height, width, 4), dtype=np.uint8)
    yy = np.arange(height, dtype=np.int32)[:, None]
    xx = np.arange(width, dtype=np.int32)[None, :]
    checker = (((yy // period) + (xx // period)) % 2) * 48 - 24
    quadrant = (yy >= height // 2).astype(np.int32) * 2 + (xx >= width // 2).astype(np.int32)
    amplitude = amp[quadrant]
    out = np.empty((height, width, 4), dtype=np.uint8)
    for c in range(3):
        gx = _ramp(width, int(ends[c, 0]), int(ends[c, 1]))[None, :]
        gy = _ramp(height, int(ends[c, 2]), int(ends[c, 3]))[:, None]
        value = (gx + gy) // 2 + checker + ((noise[..., c].astype(np.int32) - 128) * amplitude) // 128
        out[..., c] = np.clip(value, 0, 255)
    alpha_ramp = (_ramp(width, 0, 255)[None, :] + _ramp(height, 0, 255)[:, None]) // 2
    out[..., 3] = np.clip(alpha_ramp + (noise[..., 3].astype(np.int32) - 128) // 4, 0, 255)
    return out


def synth_image(width: int, height: int, mode: str, seed: int) -> Image.Image:
    """A PIL image of ``mode`` (one of :data:`MODES`) built from :func:`synth_pixels`.

    ``P``: 8-bit indices from the luminance-like mix of the RGB planes, with a
    seeded random 256-colour palette.  ``P+tRNS``: the same with palette index
    ``seed % 256`` transparent (a single ``transparency`` entry).  ``P+alpha``:
    a per-index alpha table (``transparency`` bytes), as PNG tRNS allows.
    """
    px = synth_pixels(width, height, seed)
    if mode == "RGB":
        return Image.fromarray(np.ascontiguousarray(px[..., :3]), "RGB")
    if mode == "RGBA":
        return Image.fromarray(px, "RGBA")
    gray = ((px[..., 0].astype(np.int64) * 2 + px[..., 1] * 5 + px[..., 2]) // 8).astype(np.uint8)
    if mode == "L":
        return Image.fromarray(gray, "L")
    if mode == "LA":
        return Image.fromarray(np.ascontiguousarray(np.stack([gray, px[..., 3]], axis=-1)), "LA")
    if mode in ("P", "P+tRNS", "P+alpha"):
        rng = np.random.default_rng(seed + 1)
        palette = rng.integers(0, 256, size=256 * 3, dtype=np.int64).astype(np.uint8)
        img = Image.frombytes("P", (width, height), gray.tobytes())
        img.putpalette(palette.tobytes())
        if mode == "P+tRNS":
            img.info["transparency"] = seed % 256
        elif mode == "P+alpha":
            img.info["transparency"] = rng.integers(0, 256, size=256, dtype=np.int64).astype(np.uint8).tobytes()
        return img
    raise ValueError(f"unknown mode {mode!r}")


def encode_image(img: Image.Image, fmt: str) -> bytes:
    """PNG (lossless, any mode; stored, for speed) or JPEG (quality 90, RGB/L) bytes of ``img``."""
    buf = io.BytesIO()
    if fmt == "PNG":
        kwargs = {}
        if "transparency" in img.info:
            kwargs["transparency"] = img.info["transparency"]
        img.save(buf, format="PNG", compress_level=0, **kwargs)
    elif fmt == "JPEG":
        img.save(buf, format="JPEG", quality=90)
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return buf.getvalue()


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """One corpus image: regenerated from these fields alone."""

    width: int
    height: int
    mode: str  # one of MODES
    seed: int
    fmt: str = "PNG"  # PNG | JPEG
    name: str = ""

    def label(self) -> str:
        return f"{self.name + ' ' if self.name else ''}{self.width}x{self.height} {self.mode} {self.fmt} seed={self.seed}"

    def encode(self) -> bytes:
        return encode_image(synth_image(self.width, self.height, self.mode, self.seed), self.fmt)


# ---------------------------------------------------------------- prompts


def splice_anchors(prompt_ids: Sequence[int], anchor_id: int, replacements: Sequence[Sequence[int]]) -> list[int]:
    """Replace the k-th occurrence of ``anchor_id`` by ``replacements[k]``.

    Example: ``splice_anchors([1, 9, 2, 9], 9, [[7, 7], [7]]) == [1, 7, 7, 2, 7]``.

    Raises:
        AssertionError: the anchor count differs from ``len(replacements)``.
    """
    out: list[int] = []
    k = 0
    for tok in prompt_ids:
        if tok == anchor_id:
            assert k < len(replacements), f"more anchors than images ({len(replacements)})"
            out.extend(replacements[k])
            k += 1
        else:
            out.append(tok)
    assert k == len(replacements), f"{k} anchors for {len(replacements)} images"
    return out


Turns = Sequence[tuple[str, Sequence[str | int]]]


def chat_messages(turns: Turns, image_part: Callable[[int], dict], flatten_text_turns: bool = True) -> list[dict]:
    """Chat messages with ``image_part(i)`` for an int part and ``{"type": "text"}`` parts otherwise.

    ``flatten_text_turns``: a non-user turn with one text part is a plain string (the Qwen-VL and
    Gemma 3 conversations); off, every turn is a part list (the LLaVA-NeXT template reads
    ``message['content'][0]['text']`` for system and assistant turns).
    """
    return [
        {"role": role, "content": parts[0] if flatten_text_turns and role != "user" and len(parts) == 1
            and isinstance(parts[0], str) else [
                image_part(p) if isinstance(p, int) else {"type": "text", "text": p} for p in parts]}
        for role, parts in turns
    ]


def openai_messages(turns: Turns, urls: Sequence[str]) -> list[dict]:
    """Chat messages with OpenAI ``image_url`` parts; an int in a turn is an image index."""
    return chat_messages(turns, lambda p: {"type": "image_url", "image_url": {"url": urls[p]}})


def reference_messages(turns: Turns, images: Sequence[object], flatten_text_turns: bool = True) -> list[dict]:
    """The same chat for ``processor.apply_chat_template``: ``{"type": "image", "image": PIL}`` parts."""
    return chat_messages(turns, lambda p: {"type": "image", "image": images[p]}, flatten_text_turns)


def template_messages(turns: Turns, flatten_text_turns: bool = True) -> list[dict]:
    """The chat as mmgate's planner hands it to the template: ``{"type": "image"}`` parts."""
    return chat_messages(turns, lambda p: {"type": "image"}, flatten_text_turns)


# ---------------------------------------------------------------- fingerprints


def sha256_f32le(array: np.ndarray) -> str:
    """sha256 of the float32 little-endian C-order bytes of ``array``."""
    return hashlib.sha256(np.ascontiguousarray(array, dtype="<f4").tobytes()).hexdigest()


def sha256_ids(ids: Sequence[int]) -> str:
    """sha256 of token ids as int64 little-endian."""
    return hashlib.sha256(np.asarray(list(ids), dtype="<i8").tobytes()).hexdigest()


def sha256_rgb(pixels: np.ndarray) -> str:
    """sha256 of decoded uint8 RGB pixels (C order): the ``rgb_sha256`` of a golden image entry."""
    return hashlib.sha256(np.ascontiguousarray(pixels, dtype=np.uint8).tobytes()).hexdigest()


def collapse_runs(ids: Sequence[int], tok: int) -> tuple[list[int], list[int]]:
    """(ids with each run of ``tok`` collapsed to one, the run lengths).

    Example: ``collapse_runs([1, 9, 9, 9, 2, 9], 9) == ([1, 9, 2, 9], [3, 1])``.
    """
    collapsed: list[int] = []
    runs: list[int] = []
    in_run = False
    for t in ids:
        if t == tok and in_run:
            runs[-1] += 1
            continue
        in_run = t == tok
        if in_run:
            runs.append(1)
        collapsed.append(t)
    return collapsed, runs


def whole_runs(ids: Sequence[int], tok: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each run of ``tok``.

    Example: ``whole_runs([1, 9, 9, 2, 9], 9) == [(1, 2), (4, 1)]``.
    """
    out: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == tok:
            if out and sum(out[-1]) == i:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((i, 1))
    return out


def probe8(array: np.ndarray) -> list[float]:
    """Eight exact values of ``array`` at flat indices ``k * (n - 1) // 7`` (the LLaVA rows' probe)."""
    flat = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
    return [float(flat[k * (flat.size - 1) // 7]) for k in range(8)]
