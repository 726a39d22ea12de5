"""torch-free uint8 antialiased resize (``mmgate.media.tv_resize``) against torch's own kernel.

Contenders, on the same photo-like uint8 ``[H, W, 3]`` image (``bench_report.sample_jpeg``
decoded), in one process, interleaved (each round runs all, in rotating order):

* ``torch``: what ``mmgate.models.geometry.resize_uint8`` ran for the torchvision backend
  before it went torch-free, ``tvF.resize(channels-last uint8 [3, H, W] view, [h, w],
  BICUBIC | BILINEAR, antialias=True)`` then back to a contiguous ``[h, w, 3]`` array;
* ``native``: ``resize_uint8_tv_native`` (the compiled ``mmgate._native.tvresize`` passes,
  what the gateway runs; its kernel, ``avx2`` or ``c``, is in the environment line);
* ``numpy``: ``resize_uint8_tv_numpy`` (the fallback when the extension is not built).

Before timing, all outputs are checked equal byte for byte.  Reported per case: the
median milliseconds of each and the medians over rounds of ``native / torch`` (target:
<= 1.5) and ``numpy / torch``.  ``--clock cpu`` times the calling thread's CPU time (``time.thread_time``),
which a loaded machine disturbs less; it then only counts work on this thread, so use it
with ``--single-thread`` (torch.set_num_threads(1)) and ``OPENBLAS_NUM_THREADS=1``.

Run:  python benchmarks/tv_resize.py [--rounds 15] [--clock wall|cpu] [--single-thread] [--json bench-out/tv_resize.json]
"""

from __future__ import annotations

import argparse
import io
import os
import time
from collections.abc import Callable
from functools import partial

import numpy as np
from bench_report import environment, median, render_table, sample_jpeg, write_json
from PIL import Image

from mmgate.media.tv_resize import (
    NATIVE_KERNEL,
    resize_uint8_tv_native,
    resize_uint8_tv_numpy,
)

#: (name, (in_h, in_w), (out_h, out_w)): Qwen-VL smart_resize-like targets
CASES = [
    ("640x480", (480, 640), (476, 644)),
    ("1280x960", (960, 1280), (784, 1036)),
    ("4000x3000", (3000, 4000), (966, 1288)),
    ("video 1920x1080", (1080, 1920), (476, 840)),
]
MODES = ("bicubic", "bilinear")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--single-thread", action="store_true", help="torch.set_num_threads(1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF

    if args.single_thread:
        torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    interp = {"bicubic": InterpolationMode.BICUBIC, "bilinear": InterpolationMode.BILINEAR}

    def torch_resize(pixels: np.ndarray, size_hw: tuple[int, int], mode: str) -> np.ndarray:
        tensor = torch.from_numpy(pixels).permute(2, 0, 1)
        out = tvF.resize(tensor, list(size_hw), interpolation=interp[mode], antialias=True)
        return np.ascontiguousarray(out.permute(1, 2, 0).numpy())

    env = environment() | {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"), "clock": args.clock,
                           "native_kernel": NATIVE_KERNEL}
    print(env)
    rows, results = [], []
    for name, (in_h, in_w), size_hw in CASES:
        pixels = np.asarray(Image.open(io.BytesIO(sample_jpeg(in_w, in_h))).convert("RGB"))
        for mode in MODES:
            contenders: dict[str, Callable[[], np.ndarray]] = {
                "torch": partial(torch_resize, pixels, size_hw, mode),
                "numpy": partial(resize_uint8_tv_numpy, pixels, size_hw, mode),
            }
            if NATIVE_KERNEL is not None:
                contenders["native"] = partial(resize_uint8_tv_native, pixels, size_hw, mode)
            reference = contenders["torch"]()
            for who, run in contenders.items():
                assert np.array_equal(run(), reference), (name, mode, who)
            names = list(contenders)
            times: dict[str, list[float]] = {who: [] for who in names}
            for r in range(args.rounds):
                for who in names[r % len(names):] + names[:r % len(names)]:
                    t0 = clock()
                    contenders[who]()
                    times[who].append(clock() - t0)
            ms = {who: median(times[who]) * 1e3 for who in names}
            ratio = {who: median([a / t for a, t in zip(times[who], times["torch"])]) for who in names}
            target = f"{size_hw[1]}x{size_hw[0]}"
            native_ms, native_ratio = ms.get("native", float("nan")), ratio.get("native", float("nan"))
            rows.append([name, target, mode, ms["torch"], native_ms, ms["numpy"], native_ratio, ratio["numpy"]])
            results.append({"case": name, "out": target, "mode": mode, "torch_ms": ms["torch"],
                            "native_ms": native_ms, "numpy_ms": ms["numpy"],
                            "ratio_native_over_torch": native_ratio, "ratio_numpy_over_torch": ratio["numpy"]})
            print(rows[-1], flush=True)
    print(render_table(["input", "output", "mode", "torch ms", "native ms", "numpy ms",
                        "native / torch", "numpy / torch"], rows))
    write_json(args.json, {"env": env, "results": results})


if __name__ == "__main__":
    main()
