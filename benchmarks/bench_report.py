"""Reporting helpers shared by the benchmarks: sample images, medians, tables, JSON.

Nothing here times anything.  Benchmarks report *ratios* between contenders
measured in the same process at the same moment (interleaved rounds), never
absolute numbers compared with a threshold.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = Path(os.environ.get("MMGATE_BENCH_MODELS", REPO_ROOT.parent / "shared" / "models"))

#: bundle folder -> short family label
QWEN_BUNDLES = {
    "Qwen--Qwen2-VL-2B-Instruct": "qwen2_vl",
    "Qwen--Qwen2.5-VL-7B-Instruct": "qwen2_5_vl",
    "Qwen--Qwen3-VL-2B-Instruct": "qwen3_vl",
}

#: bundle folder -> short label, one or more bundles per registered family
#: (``mmgate.models.registry.FAMILY_MODULES``): the Qwen-VL bundles, LLaVA-1.5, LLaVA-NeXT, Gemma 3, LLaVA-OneVision, Llama 4, InternVL3
FAMILY_BUNDLES = {
    **QWEN_BUNDLES,
    "llava-hf--llava-1.5-7b-hf": "llava",
    "llava-hf--llava-v1.6-mistral-7b-hf": "llava_next",
    "google--gemma-3-4b-it": "gemma3",
    "llava-hf--llava-onevision-qwen2-0.5b-ov-hf": "llava_onevision",
    "meta-llama--Llama-4-Scout-17B-16E-Instruct": "llama4",
    "OpenGVLab--InternVL3-1B-hf": "internvl",
}

#: name -> (width, height)
SIZES = {"640x480": (640, 480), "1280x960": (1280, 960)}


def sample_jpeg(width: int, height: int, seed: int = 0, quality: int = 90) -> bytes:
    """A deterministic photo-like JPEG: smooth gradients, hard-edged blocks, mild noise.

    Not random noise (which no real photo resembles and which makes JPEG decode
    unrealistically slow), not flat (which makes it unrealistically fast).
    """
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    img = np.empty((height, width, 3), dtype=np.float32)
    for c in range(3):
        a, b, f = rng.uniform(40, 200), rng.uniform(-80, 80), rng.uniform(2, 9)
        img[..., c] = a + b * x + 0.5 * b * y + 30.0 * np.sin(f * (x + 0.7 * y) * np.pi)
    block = max(8, min(width, height) // 12)
    for _ in range(24):
        x0, y0 = int(rng.integers(0, width - block)), int(rng.integers(0, height - block))
        img[y0:y0 + block, x0:x0 + 2 * block] = rng.uniform(0, 255, size=3)
    img += rng.normal(0.0, 6.0, size=img.shape).astype(np.float32)
    pixels = np.clip(img, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (q in [0, 1])."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, int(np.ceil(q * len(ordered))) - 1))
    return float(ordered[rank])


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (floats with 3 significant decimals)."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            if v != v:  # NaN
                return "n/a"
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """Where the numbers came from (recorded next to them)."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": [round(v, 2) for v in load],
        "argv": sys.argv,
    }


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    print(f"wrote {out}")
