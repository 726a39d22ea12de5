"""Image preprocessing throughput per family: mmgate against the transformers processors and a floor.

For each model bundle (``--models``, default every bundle of ``bench_report.FAMILY_BUNDLES``: the
three Qwen-VL bundles, LLaVA-1.5, LLaVA-NeXT, Gemma 3, Llama 4, at least one per family registered in
``mmgate.models.registry``) and each JPEG size (640x480, 1280x960), one process measures,
interleaved, these contenders on the same encoded bytes (decode is included in every one):

* ``mmgate/pil``, ``mmgate/torchvision``: the gateway's own calls through the generic family seam
  only (``mmgate.pipeline.prepare.Pipeline._fetch_decode`` / ``_preprocess``): ``decode_image`` ->
  ``family.image.plan(h, w)`` -> ``family.image.preprocess(decoded, plan)`` ->
  ``mmgate.models.family.assemble(family.image, [plan], [share])`` (every tensor of the batch,
  the primary and the auxiliary ones).  No family-specific code here.
* ``hf/pil``, ``hf/torchvision``: the reference the family's live-parity test
  (``tests/families/test_*_live_parity.py``) compares with, transformers' image processor of
  that backend called on ``PIL.Image.open(BytesIO(bytes))`` with ``return_tensors="np"``:
  ``torchvision``: ``AutoProcessor.from_pretrained(bundle).image_processor``; ``pil``:
  ``AutoImageProcessor.from_pretrained(bundle, backend="pil")``; both called with the
  ``images_kwargs`` class attribute of the bundle's processor class (what the processor itself
  passes its image processor: ``Gemma3Processor`` -> ``do_convert_rgb=True``, pan-and-scan off;
  ``LlavaNextProcessor`` -> ``do_pad=True``, its image processor's default; none for Qwen-VL and
  LLaVA-1.5).  This is the only per-family difference, and it lives in transformers' classes.
  Llama 4 has one image processor (``Llama4ImageProcessor``, torchvision; ``backend="pil"`` falls
  back to it in transformers itself) whose ``pixel_values`` are bfloat16: it is called with
  ``return_tensors="pt"`` (numpy has no bfloat16) and compared as float32 values.
* ``floor`` (generic, every family): Pillow JPEG decode + ``convert("RGB")`` + ONE resize to the
  plan's ``resized_hw`` with the filter the bundle's ``preprocessor_config.json`` names
  (``resample``; bicubic when absent) + one write of a float32 array of the size of the item's
  primary tensor (``plan.primary_shape``).  For Qwen-VL this is exactly the former Qwen-only
  floor (one bicubic resize, ``[patches, patch_dim]`` float32).  No real preprocessor can do less
  work; families that resize more than once (LLaVA-NeXT's base image + anyres tiles) or crop and
  pad sit further above it by construction.

Before timing, each mmgate backend's batch is compared with its transformers twin: the primary
tensor (shape, dtype, max |diff|) and every auxiliary tensor both produce (``image_grid_thw``,
``image_sizes``); any difference aborts the run (exit status 1) -- timing outputs
that differ would be meaningless.

Rounds: each round runs every (bundle, size, contender) cell for about ``--min-time`` seconds, the
contenders of a cell in a rotated order; ratios are taken within a round (same moment) and the
median over rounds is reported, with the median images/s of each contender.

Run:  python benchmarks/preprocess.py [--models qwen2_5_vl gemma3 ...] [--rounds 7] [--min-time 0.15]
                                       [--json bench-out/preprocess.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from bench_report import (
    FAMILY_BUNDLES,
    MODELS_DIR,
    SIZES,
    environment,
    median,
    render_table,
    sample_jpeg,
    write_json,
)
from PIL import Image

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.media.image import decode_image
from mmgate.models.bundle import load_bundle
from mmgate.models.family import assemble
from mmgate.models.registry import FAMILY_BY_MODEL_TYPE, load_family
from mmgate.config.settings import DEFAULT_MAX_IMAGE_PIXELS
from mmgate.models.backend import ImageBackend

CONTENDERS = ("mmgate/pil", "mmgate/torchvision", "hf/pil", "hf/torchvision", "floor")
BACKENDS = {"pil": ImageBackend.PIL, "torchvision": ImageBackend.TORCHVISION}
#: (numerator, denominator, label): speed ratios reported per cell (> 1: numerator faster)
RATIOS = (
    ("mmgate/pil", "hf/pil", "mmgate/hf pil"),
    ("mmgate/torchvision", "hf/torchvision", "mmgate/hf tv"),
    ("mmgate/pil", "floor", "mmgate pil/floor"),
    ("mmgate/torchvision", "floor", "mmgate tv/floor"),
)


@dataclass
class Cell:
    """One (bundle, size) and its contenders, each a zero-argument call on the same bytes."""

    family: str  # the bundle's short label (bench_report.FAMILY_BUNDLES)
    size: str
    data: bytes
    fns: dict[str, Callable[[], Any]]
    iters: dict[str, int]
    rates: dict[str, list[float]]  # contender -> images/s per round
    primary_shape: tuple[int, ...] = ()
    num_tokens: int = 0


def mmgate_fn(family: Any, data: bytes) -> Callable[[], dict[str, np.ndarray]]:
    """The gateway's image path through the seam: decode, plan, preprocess, assemble."""
    proc = family.image

    def run() -> dict[str, np.ndarray]:
        decoded = decode_image(data, DEFAULT_MAX_IMAGE_PIXELS)
        plan = proc.plan(decoded.height, decoded.width)
        share = proc.preprocess(decoded, plan)
        batch = assemble(proc, [plan], [share])
        return {"__primary__": batch.tensors[batch.primary_key], **batch.tensors}

    return run


def hf_fn(processor: Any, kwargs: dict[str, Any], data: bytes) -> Callable[[], Any]:
    tensors = _return_tensors(processor, kwargs, data)

    def run() -> Any:
        return processor(images=[Image.open(io.BytesIO(data))], **kwargs, return_tensors=tensors)

    return run


def _return_tensors(processor: Any, kwargs: dict[str, Any], data: bytes) -> str:
    """``"np"``, or ``"pt"`` where the processor's output has no numpy form (Llama 4's bfloat16
    ``pixel_values``: ``Llama4ImageProcessor.rescale_and_normalize`` computes in bfloat16)."""
    try:
        processor(images=[Image.open(io.BytesIO(data))], **kwargs, return_tensors="np")
    except (TypeError, ValueError):
        return "pt"
    return "np"


def _as_numpy(value: Any) -> np.ndarray:
    """A reference tensor as numpy (a torch bfloat16 tensor as its float32 values, exact)."""
    if hasattr(value, "float") and str(getattr(value, "dtype", "")) == "torch.bfloat16":
        return value.float().numpy()
    return np.asarray(value)


def floor_fn(data: bytes, resized_hw: tuple[int, int], out_shape: tuple[int, ...], resample: int) -> Callable[[], np.ndarray]:
    def run() -> np.ndarray:
        with Image.open(io.BytesIO(data)) as im:
            rgb = im.convert("RGB").resize((resized_hw[1], resized_hw[0]), resample=resample)
        np.asarray(rgb)
        out = np.empty(out_shape, dtype=np.float32)
        out.fill(0.5)
        return out

    return run


def resolve_models(names: list[str]) -> list[str]:
    """Bundle folders from folder names or short labels (``qwen2_5_vl``, ``gemma3``)."""
    by_label = {label: folder for folder, label in FAMILY_BUNDLES.items()}
    out = []
    for name in names:
        folder = name if name in FAMILY_BUNDLES else by_label.get(name)
        if folder is None:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(FAMILY_BUNDLES.values())}")
        out.append(folder)
    return out


def coverage(folders: list[str]) -> list[str]:
    """Registered family classes with no bundle among ``folders`` (empty: every family is measured)."""
    measured = {FAMILY_BY_MODEL_TYPE.get(load_bundle(MODELS_DIR / f).model_type) for f in folders}
    return sorted({cls.__name__ for cls in FAMILY_BY_MODEL_TYPE.values() if cls not in measured})


def build_cells(folders: list[str], sizes: list[str]) -> tuple[list[Cell], dict[str, dict[str, Any]]]:
    from transformers import AutoImageProcessor, AutoProcessor

    cells: list[Cell] = []
    refs: dict[str, dict[str, Any]] = {}
    for folder in folders:
        path = MODELS_DIR / folder
        bundle = load_bundle(path)
        tok = load_tokenizer(bundle)
        fam = {name: load_family(bundle, tok, be) for name, be in BACKENDS.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            processor = AutoProcessor.from_pretrained(str(path))
            hf = {"pil": AutoImageProcessor.from_pretrained(str(path), backend="pil"),
                  "torchvision": processor.image_processor}
        kwargs = dict(getattr(type(processor), "images_kwargs", None) or {})
        label = FAMILY_BUNDLES[folder]
        refs[label] = {"family": type(fam["pil"]).__name__, "processor": type(processor).__name__,
                       "hf_pil": type(hf["pil"]).__name__, "hf_torchvision": type(hf["torchvision"]).__name__,
                       "images_kwargs": kwargs}
        resample = int(bundle.preprocessor_config.get("resample") or Image.Resampling.BICUBIC)
        for size in sizes:
            w, h = SIZES[size]
            data = sample_jpeg(w, h, seed=zlib.crc32(f"{folder}/{size}".encode()))
            plan = fam["pil"].image.plan(h, w)
            fns: dict[str, Callable[[], Any]] = {
                "mmgate/pil": mmgate_fn(fam["pil"], data),
                "mmgate/torchvision": mmgate_fn(fam["torchvision"], data),
                "hf/pil": hf_fn(hf["pil"], kwargs, data),
                "hf/torchvision": hf_fn(hf["torchvision"], kwargs, data),
                "floor": floor_fn(data, plan.resized_hw, plan.primary_shape, resample),
            }
            cells.append(Cell(label, size, data, fns, {}, {c: [] for c in CONTENDERS},
                              tuple(plan.primary_shape), plan.num_tokens))
    return cells, refs


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.size == 0 or np.array_equal(a, b):
        return 0.0
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def check_parity(cell: Cell) -> tuple[list[str], bool]:
    """mmgate/<backend> against hf/<backend>: primary tensor and shared auxiliary tensors identical."""
    lines, ok = [], True
    for be in BACKENDS:
        ours = cell.fns[f"mmgate/{be}"]()
        ref = cell.fns[f"hf/{be}"]()
        primary, ref_primary = ours["__primary__"], _as_numpy(ref["pixel_values"])
        head = f"{cell.family} {cell.size} {be}:"
        if primary.shape != ref_primary.shape or primary.dtype != ref_primary.dtype:
            lines.append(f"{head} MISMATCH primary {primary.dtype}{primary.shape} vs reference "
                         f"{ref_primary.dtype}{ref_primary.shape}")
            ok = False
            continue
        diff = _max_abs_diff(primary, ref_primary)
        aux = []
        for key in sorted(set(ours) & set(ref.keys()) - {"__primary__", "pixel_values"}):
            same = np.array_equal(np.asarray(ours[key]), np.asarray(ref[key]))
            aux.append(f"{key} {'equal' if same else 'DIFFERS'}")
            ok &= same
        ok &= diff == 0.0
        lines.append(f"{head} pixel_values {primary.dtype}{tuple(primary.shape)} max|diff| {diff:g}"
                     + (f"; {', '.join(aux)}" if aux else "") + ("" if diff == 0.0 else "  MISMATCH"))
    floor_size = np.asarray(cell.fns["floor"]()).size
    if floor_size != cell.fns["mmgate/pil"]()["__primary__"].size:
        lines.append(f"{cell.family} {cell.size} floor: SIZE MISMATCH {floor_size}")
        ok = False
    return lines, ok


def calibrate(cell: Cell, min_time: float) -> None:
    """Iterations per contender so that one measurement lasts about ``min_time`` seconds."""
    for name, fn in cell.fns.items():
        fn()  # warm-up (lazy imports, LUTs, allocator)
        t0 = time.perf_counter()
        fn()
        one = max(time.perf_counter() - t0, 1e-6)
        cell.iters[name] = max(2, round(min_time / one))


def measure(fn: Callable[[], Any], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return iters / (time.perf_counter() - t0)


def profile_mmgate(cells: list[Cell], top: int) -> str:
    """cProfile of the mmgate contenders of each bundle's largest cell (where the time goes)."""
    largest: dict[str, Cell] = {}
    for c in cells:
        if c.family not in largest or SIZES[c.size][0] > SIZES[largest[c.family].size][0]:
            largest[c.family] = c
    out = io.StringIO()
    for cell in largest.values():
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
    ap.add_argument("--models", "--families", nargs="*", default=list(FAMILY_BUNDLES),
                    help="bundle folder names or short labels (default: all of bench_report.FAMILY_BUNDLES)")
    ap.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--profile", action="store_true", help="also cProfile mmgate's contenders on each largest cell")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)

    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    folders = resolve_models(args.models)
    env = environment() | {"torch_threads": torch.get_num_threads(), "models_dir": str(MODELS_DIR)}
    print(f"# preprocess benchmark  {env['date_utc']}  cpus={env['cpus']} load={env['loadavg_at_start']} "
          f"torch_threads={env['torch_threads']}")
    missing = coverage(folders)
    print("registered families not measured: " + (", ".join(missing) if missing else "none"))

    cells, refs = build_cells(folders, args.sizes)
    for label, ref in refs.items():
        print(f"{label}: {ref['family']}; reference {ref['processor']} -> {ref['hf_torchvision']} / {ref['hf_pil']} "
              f"images_kwargs={ref['images_kwargs']}")
    parity: list[str] = []
    all_equal = True
    for c in cells:
        lines, ok = check_parity(c)
        parity += lines
        all_equal &= ok
    print("\n".join(parity))
    if not all_equal:
        print("mmgate's output differs from the reference: not timing", file=sys.stderr)
        return 1
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
    load_end = [round(v, 2) for v in os.getloadavg()]

    headers = ["family", "image", "pixel_values/item", "tokens",
               "mmgate/pil img/s", "hf/pil img/s", "mmgate/hf pil",
               "mmgate/tv img/s", "hf/tv img/s", "mmgate/hf tv",
               "floor img/s", "mmgate pil/floor", "mmgate tv/floor"]
    rows = []
    results = []
    for c in cells:
        med = {n: median(c.rates[n]) for n in CONTENDERS}
        rat = {label: median(v) for label, v in ratios[(c.family, c.size)].items()}
        rows.append([c.family, c.size, "x".join(map(str, c.primary_shape)), c.num_tokens,
                     med["mmgate/pil"], med["hf/pil"], rat["mmgate/hf pil"],
                     med["mmgate/torchvision"], med["hf/torchvision"], rat["mmgate/hf tv"],
                     med["floor"], rat["mmgate pil/floor"], rat["mmgate tv/floor"]])
        results.append({"family": c.family, "image": c.size, "jpeg_bytes": len(c.data),
                        "primary_shape": list(c.primary_shape), "num_tokens": c.num_tokens, "iters": c.iters,
                        "images_per_s_median": med, "images_per_s_rounds": c.rates,
                        "ratios_median": rat, "ratios_rounds": ratios[(c.family, c.size)]})
    print()
    print(render_table(headers, rows))
    print("\nratios: median over rounds of the per-round ratio of images/s (> 1: the first is faster).")
    print(f"load average at start {env['loadavg_at_start']}, at end {load_end}; "
          f"{time.perf_counter() - t_start:.0f}s of timed rounds")
    prof_text = profile_mmgate(cells, 18) if args.profile else ""
    if prof_text:
        print(prof_text)
    write_json(args.json, {"benchmark": "preprocess", "env": env | {"loadavg_at_end": load_end},
                           "rounds": args.rounds, "min_time_s": args.min_time, "references": refs,
                           "parity": parity, "results": results, "profile": prof_text or None})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
