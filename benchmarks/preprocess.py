"""Image preprocessing throughput: mmgate against the transformers processors and a floor.

For each Qwen-VL family bundle (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and each JPEG
size (640x480, 1280x960), one process measures, interleaved, these contenders
on the same encoded bytes (decode is included in every one):

* ``mmgate/pil``, ``mmgate/torchvision``: ``decode_image`` + ``family.plan`` +
  ``family.preprocess_one`` + ``family.assemble`` (the gateway's own calls,
  ``mmgate.pipeline.Pipeline._fetch_decode`` / ``_preprocess``).
* ``hf/pil``, ``hf/torchvision``: ``AutoImageProcessor.from_pretrained(bundle,
  backend=...)`` called on ``PIL.Image.open(BytesIO(bytes))`` with
  ``return_tensors="np"`` (what mmgate is exact to).
* ``floor``: Pillow JPEG decode + ``convert("RGB")`` + one bicubic resize to the
  planned size + one write of a float32 array of the final ``pixel_values``
  size.  No real preprocessor can do less work.

Rounds: each round runs every (family, size, contender) cell for about
``--min-time`` seconds, the contenders of a cell in a rotated order; ratios are
taken within a round (same moment) and the median over rounds is reported,
with the median images/s of each contender.  Before timing, the output of
each mmgate backend is compared with its transformers twin (max |diff|, shape).

Run:  python benchmarks/preprocess.py [--rounds 7] [--min-time 0.15] [--json bench-out/preprocess.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from bench_report import MODELS_DIR, QWEN_BUNDLES, SIZES, environment, median, render_table, sample_jpeg, write_json

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.media.image import decode_image
from mmgate.models.bundle import load_bundle
from mmgate.models.registry import load_family
from mmgate.settings import DEFAULT_MAX_IMAGE_PIXELS, ImageBackend
from mmgate.types import Modality

CONTENDERS = ("mmgate/pil", "mmgate/torchvision", "hf/pil", "hf/torchvision", "floor")
#: (numerator, denominator, label): speed ratios reported per cell (> 1: numerator faster)
RATIOS = (
    ("mmgate/pil", "hf/pil", "mmgate/hf pil"),
    ("mmgate/torchvision", "hf/torchvision", "mmgate/hf tv"),
    ("mmgate/pil", "floor", "mmgate pil/floor"),
    ("mmgate/torchvision", "floor", "mmgate tv/floor"),
)


@dataclass
class Cell:
    """One (family, size) and its contenders, each a zero-argument call on the same bytes."""

    family: str
    size: str
    data: bytes
    fns: dict[str, Callable[[], Any]]
    iters: dict[str, int]
    rates: dict[str, list[float]]  # contender -> images/s per round


def mmgate_fn(family: Any, data: bytes) -> Callable[[], np.ndarray]:
    def run() -> np.ndarray:
        decoded = decode_image(data, DEFAULT_MAX_IMAGE_PIXELS)
        plan = family.plan(Modality.IMAGE, decoded.height, decoded.width)
        row = family.preprocess_one(decoded, plan)
        return family.assemble([row], [plan]).tensors["pixel_values"]

    return run


def hf_fn(processor: Any, data: bytes) -> Callable[[], np.ndarray]:
    def run() -> np.ndarray:
        return processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"]

    return run


def floor_fn(data: bytes, resized_hw: tuple[int, int], out_shape: tuple[int, int], resample: int) -> Callable[[], np.ndarray]:
    def run() -> np.ndarray:
        with Image.open(io.BytesIO(data)) as im:
            rgb = im.convert("RGB").resize((resized_hw[1], resized_hw[0]), resample=resample)
        np.asarray(rgb)
        out = np.empty(out_shape, dtype=np.float32)
        out.fill(0.5)
        return out

    return run


def build_cells(families: list[str], sizes: list[str]) -> list[Cell]:
    from transformers import AutoImageProcessor

    cells: list[Cell] = []
    for folder in families:
        path = MODELS_DIR / folder
        bundle = load_bundle(path)
        tok = load_tokenizer(bundle)
        fam = {be: load_family(bundle, tok, be) for be in (ImageBackend.PIL, ImageBackend.TORCHVISION)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = {"pil": AutoImageProcessor.from_pretrained(str(path), backend="pil"),
                  "torchvision": AutoImageProcessor.from_pretrained(str(path), backend="torchvision")}
        for size in sizes:
            w, h = SIZES[size]
            data = sample_jpeg(w, h, seed=zlib.crc32(f"{folder}/{size}".encode()))
            plan = fam[ImageBackend.PIL].plan(Modality.IMAGE, h, w)
            patch_dim = fam[ImageBackend.PIL].image.patch_dim
            fns: dict[str, Callable[[], Any]] = {
                "mmgate/pil": mmgate_fn(fam[ImageBackend.PIL], data),
                "mmgate/torchvision": mmgate_fn(fam[ImageBackend.TORCHVISION], data),
                "hf/pil": hf_fn(hf["pil"], data),
                "hf/torchvision": hf_fn(hf["torchvision"], data),
                "floor": floor_fn(data, plan.resized_hw, (plan.num_patches, patch_dim), fam[ImageBackend.PIL].image.resample),
            }
            cells.append(Cell(QWEN_BUNDLES[folder], size, data, fns, {}, {c: [] for c in CONTENDERS}))
    return cells


def check_parity(cell: Cell) -> list[str]:
    """mmgate/<backend> against hf/<backend>: same shape, max |diff| (0 expected)."""
    lines = []
    for be in ("pil", "torchvision"):
        ours = np.asarray(cell.fns[f"mmgate/{be}"]())
        ref = np.asarray(cell.fns[f"hf/{be}"]())
        if ours.shape != ref.shape:
            lines.append(f"{cell.family} {cell.size} {be}: SHAPE MISMATCH {ours.shape} vs {ref.shape}")
            continue
        diff = float(np.max(np.abs(ours.astype(np.float64) - ref.astype(np.float64)))) if ours.size else 0.0
        lines.append(f"{cell.family} {cell.size} {be}: pixel_values {tuple(ours.shape)} max|diff| {diff:g}")
    floor_shape = np.asarray(cell.fns["floor"]()).shape
    if floor_shape != np.asarray(cell.fns["mmgate/pil"]()).shape:
        lines.append(f"{cell.family} {cell.size} floor: SHAPE MISMATCH {floor_shape}")
    return lines


def calibrate(cell: Cell, min_time: float) -> None:
    """Iterations per contender so that one measurement lasts about ``min_time`` seconds."""
    for name, fn in cell.fns.items():
        fn()  # warm-up (lazy imports, LUTs, allocator)
        t0 = time.perf_counter()
        fn()
        one = max(time.perf_counter() - t0, 1e-6)
        cell.iters[name] = max(2, int(round(min_time / one)))


def measure(fn: Callable[[], Any], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return iters / (time.perf_counter() - t0)


def profile_mmgate(cells: list[Cell], top: int) -> str:
    """cProfile of the mmgate contenders of the largest cell (where the time goes)."""
    cell = max(cells, key=lambda c: SIZES[c.size][0])
    out = io.StringIO()
    for name in ("mmgate/pil", "mmgate/torchvision"):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(max(5, cell.iters[name])):
            cell.fns[name]()
        prof.disable()
        out.write(f"\n### cProfile {name} {cell.family} {cell.size} (tottime)\n")
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-time", type=float, default=0.15, help="seconds per (cell, contender) measurement")
    ap.add_argument("--families", nargs="*", default=list(QWEN_BUNDLES), help="bundle folder names")
    ap.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--profile", action="store_true", help="also cProfile mmgate's contenders on the largest cell")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)

    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    env = environment() | {"torch_threads": torch.get_num_threads(), "models_dir": str(MODELS_DIR)}
    print(f"# preprocess benchmark  {env['date_utc']}  cpus={env['cpus']} load={env['loadavg_at_start']} "
          f"torch_threads={env['torch_threads']}")

    cells = build_cells(args.families, args.sizes)
    parity = [line for c in cells for line in check_parity(c)]
    print("\n".join(parity))
    for c in cells:
        calibrate(c, args.min_time)

    t_start = time.perf_counter()
    ratios: dict[tuple[str, str], dict[str, list[float]]] = {(c.family, c.size): {r[2]: [] for r in RATIOS} for c in cells}
    for rnd in range(args.rounds):
        for c in cells:
            order = CONTENDERS[rnd % len(CONTENDERS):] + CONTENDERS[:rnd % len(CONTENDERS)]
            now = {name: measure(c.fns[name], c.iters[name]) for name in order}
            for name, rate in now.items():
                c.rates[name].append(rate)
            for num, den, label in RATIOS:
                ratios[(c.family, c.size)][label].append(now[num] / now[den])
        print(f"round {rnd + 1}/{args.rounds} done ({time.perf_counter() - t_start:.0f}s)", file=sys.stderr)

    headers = ["family", "image", *[f"{n} img/s" for n in CONTENDERS], *[r[2] for r in RATIOS]]
    rows = []
    results = []
    for c in cells:
        med = {n: median(c.rates[n]) for n in CONTENDERS}
        rat = {label: median(v) for label, v in ratios[(c.family, c.size)].items()}
        rows.append([c.family, c.size, *[med[n] for n in CONTENDERS], *[rat[r[2]] for r in RATIOS]])
        results.append({"family": c.family, "image": c.size, "jpeg_bytes": len(c.data), "iters": c.iters,
                        "images_per_s_median": med, "images_per_s_rounds": c.rates,
                        "ratios_median": rat, "ratios_rounds": ratios[(c.family, c.size)]})
    print()
    print(render_table(headers, rows))
    print("\nratios: median over rounds of the per-round ratio of images/s (> 1: the first is faster).")
    prof_text = profile_mmgate(cells, 18) if args.profile else ""
    if prof_text:
        print(prof_text)
    write_json(args.json, {"benchmark": "preprocess", "env": env, "rounds": args.rounds, "min_time_s": args.min_time,
                           "parity": parity, "results": results, "profile": prof_text or None})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
