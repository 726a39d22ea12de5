"""Qwen-VL patch rows: the compiled kernel (``mmgate._native.patchrows``) against the numpy path, as ratios.

What is timed is the step after the resize: a resized uint8 image (or a clip's frames) -> its
``pixel_values`` rows in their destination.  Per model (Qwen2.5-VL: patch 14, CLIP mean/std;
Qwen3-VL: patch 16, mean/std 0.5; the torchvision backend's table and the normalizer the family
itself builds) and per JPEG size (640x480 and 1280x960, resized to the family's plan), one
process measures, interleaved, ``numpy`` (``native=False``) against ``native`` for:

* ``inline``: ``image_rows.write_rows`` into a :class:`~mmgate.transport.placement.BufferTarget`
  over a fresh ``new_bytes`` payload (the inline gRPC path; what ``pipeline._fill_images``
  streams, identity convert);
* ``array``: ``image_rows.image_rows`` (``QwenVLImage.preprocess``: the cached path), a new array;
* ``raw``: ``inline`` with raw uint8 rows (``mm_device_do_normalize``);
* ``video``: a clip of 16 frames at the family's plan for a 640x360 clip: the numpy path of
  ``video_pixels.FrameProcessor`` (``patchify_video`` + ``normalize_rows``) against
  ``patch_native.fill_rows`` into a new array (what FrameProcessor would call).

Before timing, every pair's output is checked equal bit for bit.  Each round runs both
contenders of a cell ``--repeat`` times in a rotated order; the reported ratio is the median over
rounds of ``numpy seconds / native seconds`` (> 1: the kernel is faster), with the median
milliseconds of each.  Single-threaded: the pool runs two of these at once (the kernel
releases the GIL; the numpy path mostly does too, inside its ufuncs and copies).

``--sink`` measures instead, for the ``inline`` and ``raw`` cells, the compiled kernel writing
cache-sized blocks that are copied into the request payload (``blocks``: the sink a plain callable)
against the kernel writing straight into the payload through its
:class:`~mmgate.types.RowArray` (``direct``: what the gateway does).

Run:  python benchmarks/patch_rows.py [--sink] [--rounds 9] [--repeat 5] [--json bench-out/patch_rows.json]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from bench_report import (
    MODELS_DIR,
    SIZES,
    environment,
    median,
    render_table,
    sample_jpeg,
    write_json,
)

from mmgate.chat.tokenizer import load_tokenizer
from mmgate.media.image import decode_image
from mmgate.models import patch_native
from mmgate.models.bundle import load_bundle
from mmgate.models.image_rows import image_rows, write_rows
from mmgate.models.registry import load_family
from mmgate.models.video_pixels import normalize_rows, patchify_video
from mmgate.config.settings import DEFAULT_MAX_IMAGE_PIXELS
from mmgate.models.backend import ImageBackend
from mmgate.transport.placement import BufferTarget, new_bytes

MODELS = {"qwen2_5_vl": "Qwen--Qwen2.5-VL-7B-Instruct", "qwen3_vl": "Qwen--Qwen3-VL-2B-Instruct"}
#: frames of the video cell (8 s at Qwen3-VL's default 2 fps), sampled from a 640x360 clip
VIDEO_FRAMES, VIDEO_HW = 16, (360, 640)

Fn = Callable[[], Any]


def inline_fn(pixels: np.ndarray, p: int, m: int, t: int, normalizer: Any, native: bool, blocks: bool = False) -> Fn:
    """``write_rows`` into a BufferTarget over a new request payload; ``blocks``: the writer as a plain
    callable, so the kernel writes cache-sized blocks that are copied in (the path before ``RowArray``)."""
    rows = (pixels.shape[0] // p) * (pixels.shape[1] // p)
    width = pixels.shape[2] * t * p * p
    item = 1 if normalizer is None else 4

    def run() -> bytes:
        data, view = new_bytes(rows * width * item)
        target = BufferTarget(view, width, item, owner=data, values=np.dtype(np.uint8 if item == 1 else np.float32))
        with target.writer() as put:
            sink = (lambda row, block: put(row, block)) if blocks else put
            write_rows(pixels, p, m, t, normalizer, sink, native=native)
        return data

    return run


def sink_cells() -> list[tuple[str, str, str, Fn, Fn]]:
    """(model, size, path, blocks fn, direct fn): the compiled kernel's rows copied in block by block
    against computed straight into the request payload (``--sink``)."""
    out: list[tuple[str, str, str, Fn, Fn]] = []
    for label, proc in processors():
        prm = proc.params
        p, m, t, norm = prm.patch_size, prm.merge_size, prm.temporal_patch_size, proc._normalizer
        for size, (w, h) in SIZES.items():
            image = decode_image(sample_jpeg(w, h), DEFAULT_MAX_IMAGE_PIXELS)
            px = proc.resized(image, proc.plan(*image.pixels.shape[:2])).pixels
            label_size = f"{size}->{px.shape[1]}x{px.shape[0]}"
            out.append((label, label_size, "inline", inline_fn(px, p, m, t, norm, True, blocks=True),
                        inline_fn(px, p, m, t, norm, True)))
            out.append((label, label_size, "raw", inline_fn(px, p, m, t, None, True, blocks=True),
                        inline_fn(px, p, m, t, None, True)))
    return out


def processors() -> list[tuple[str, Any]]:
    """``(model label, Qwen-VL image processor)`` per model of :data:`MODELS` (torchvision backend)."""
    out = []
    for label, folder in MODELS.items():
        bundle = load_bundle(MODELS_DIR / folder)
        family = load_family(bundle, load_tokenizer(bundle), ImageBackend.TORCHVISION)
        assert family is not None and family.image is not None
        out.append((label, family.image))
    return out


def cells(rng: np.random.Generator) -> list[tuple[str, str, str, Fn, Fn]]:
    """(model, size, path, numpy fn, native fn) per cell."""
    out: list[tuple[str, str, str, Fn, Fn]] = []
    for label, proc in processors():
        prm = proc.params
        p, m, t, norm = prm.patch_size, prm.merge_size, prm.temporal_patch_size, proc._normalizer
        for size, (w, h) in SIZES.items():
            image = decode_image(sample_jpeg(w, h), DEFAULT_MAX_IMAGE_PIXELS)
            plan = proc.plan(*image.pixels.shape[:2])
            px = proc.resized(image, plan).pixels
            label_size = f"{size}->{px.shape[1]}x{px.shape[0]}"
            out.append((label, label_size, "inline", inline_fn(px, p, m, t, norm, False),
                        inline_fn(px, p, m, t, norm, True)))
            out.append((label, label_size, "array", lambda px=px, p=p, m=m, t=t, n=norm: image_rows(px, p, m, t, n, False),
                        lambda px=px, p=p, m=m, t=t, n=norm: image_rows(px, p, m, t, n, True)))
            out.append((label, label_size, "raw", inline_fn(px, p, m, t, None, False),
                        inline_fn(px, p, m, t, None, True)))
        vh, vw = (x - x % prm.factor for x in VIDEO_HW)
        clip = rng.integers(0, 256, (VIDEO_FRAMES, vh, vw, 3), dtype=np.uint8)
        lut = norm.lut

        def video_numpy(clip: np.ndarray = clip, p: int = p, m: int = m, t: int = t, n: Any = norm) -> np.ndarray:
            return normalize_rows(patchify_video(clip, p, m, t), n)

        def video_native(clip: np.ndarray = clip, p: int = p, m: int = m, t: int = t, lut: Any = lut) -> np.ndarray:
            rows = np.empty((patch_native.row_count(clip.shape, p, t), 3 * t * p * p), np.float32)
            patch_native.fill_rows(clip, p, m, t, lut, rows)
            return rows

        out.append((label, f"{VIDEO_FRAMES}x{vw}x{vh}", "video", video_numpy, video_native))
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, bytes):
        return a == b
    return bool(np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sink", action="store_true",
                    help="the kernel's blocks copied into the request payload against rows computed in place")
    args = ap.parse_args()
    if not patch_native.NATIVE:
        raise SystemExit("mmgate._native.patchrows is not built (pip install -e . with a C compiler)")
    first, second = ("blocks", "direct") if args.sink else ("numpy", "native")
    table = sink_cells() if args.sink else cells(np.random.default_rng(0))
    for model, size, path, old, new in table:
        if not same(old(), new()):
            raise SystemExit(f"{model} {size} {path}: {second} rows differ from the {first} path")
    times: dict[int, dict[str, list[float]]] = {i: {first: [], second: [], "ratio": []} for i in range(len(table))}
    for rnd in range(args.rounds):
        for i, (_, _, _, old, new) in enumerate(table):
            pair = [(first, old), (second, new)]
            if (rnd + i) % 2:
                pair.reverse()
            got: dict[str, float] = {}
            for name, fn in pair:
                t0 = time.perf_counter()
                for _ in range(args.repeat):
                    fn()
                got[name] = (time.perf_counter() - t0) / args.repeat
            times[i][first].append(got[first])
            times[i][second].append(got[second])
            times[i]["ratio"].append(got[first] / got[second])
    rows = []
    for i, (model, size, path, _, _) in enumerate(table):
        rows.append([model, size, path, median(times[i][first]) * 1e3, median(times[i][second]) * 1e3,
                     median(times[i]["ratio"])])
    print(render_table(["model", "size", "path", f"{first} ms", f"{second} ms", f"{first}/{second}"], rows))
    write_json(args.json, {"benchmark": "patch_rows", "mode": "sink" if args.sink else "kernel",
                           "environment": environment(), "rounds": args.rounds, "repeat": args.repeat,
                           "cells": [dict(zip(("model", "size", "path", f"{first}_ms", f"{second}_ms", "ratio"), r))
                                     for r in rows]})


if __name__ == "__main__":
    main()
