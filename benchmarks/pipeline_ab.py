"""Before/after: the gateway's request pipeline of two source trees, same machine, same minute.

Each contender is one source tree (``--tree NAME=PATH``, PATH holding ``src/mmgate``; default:
this tree as ``after``).  Per round and per cell, a fresh subprocess of each tree (alternating
which goes first) builds the ``Pipeline`` of the model in-process (no HTTP, no engine) and runs
``Pipeline.prepare`` on chat requests carrying one JPEG as a data URL (fetch = base64 decode,
image decode, plan, render + tokenize, preprocess into one array, expand), one at a time, for
``--min-time`` seconds after a warm-up.  Reported per cell: requests/s of each tree per round,
the median, and the median of the per-round ratios (after/before).  What changes between the
trees is only the code: same bytes, same bundle, same thread pool size.

Use it to show a refactor does not slow the request path, e.g. the family seam:

    git worktree add /tmp/mmgate-before <commit>
    python benchmarks/pipeline_ab.py --tree before=/tmp/mmgate-before --tree after=. --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_report import MODELS_DIR, REPO_ROOT, SIZES, median, render_table, write_json

_CHILD = r"""
import asyncio, base64, gc, json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, os.path.join(os.environ["BENCH_DIR"]))
from bench_report import sample_jpeg
from mmgate.chat.tokenizer import load_tokenizer
from mmgate.media.fetch import MediaFetcher
from mmgate.models.bundle import load_bundle
from mmgate.models.geometry import resolve_backend
from mmgate.models.registry import load_family
try:  # the layout since issue 22
    from mmgate.request.parse import parse_chat_request
    from mmgate.pipeline.prepare import Pipeline
    from mmgate.pipeline.runtime import ModelRuntime
    from mmgate.config.settings import Settings
    from mmgate.models.backend import ImageBackend
except ImportError:  # a tree from before it (e.g. 05281ae), for before/after runs
    from mmgate.api.protocol import parse_chat_request
    from mmgate.pipeline import ModelRuntime, Pipeline
    from mmgate.settings import ImageBackend, Settings

bundle_dir, width, height, min_time, backend = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
bundle = load_bundle(bundle_dir)
tok = load_tokenizer(bundle)
family = load_family(bundle, tok, resolve_backend(ImageBackend(backend)))
runtime = ModelRuntime(bundle=bundle, tokenizer=tok, family=family, served_name=bundle.name)
settings = Settings(model=bundle_dir)
url = "data:image/jpeg;base64," + base64.b64encode(sample_jpeg(width, height)).decode()
body = json.dumps({"model": bundle.name, "max_tokens": 1, "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the image."}]}]}).encode()

async def main():
    pipe = Pipeline(runtime, settings, MediaFetcher(settings.fetch), ThreadPoolExecutor(2))
    for _ in range(3):
        await pipe.prepare(parse_chat_request(body))
    gc.collect()
    gc.freeze()  # the first full collection after start-up (100-500 ms) must not land in one tree's window
    n, start = 0, time.perf_counter()
    cpu0 = time.process_time()
    while time.perf_counter() - start < min_time:
        await pipe.prepare(parse_chat_request(body))
        n += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    print(json.dumps({"rps": n / wall, "cpu_ms": 1000 * cpu / n, "n": n}))

asyncio.run(main())
"""


def run_tree(path: Path, bundle: Path, size: tuple[int, int], min_time: float, backend: str) -> dict[str, float]:
    """One timed run of ``path``'s pipeline in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=str(path / "src"), BENCH_DIR=str(REPO_ROOT / "benchmarks"),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(bundle), str(size[0]), str(size[1]), str(min_time), backend],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="a source tree to time (first = before, last = after)")
    ap.add_argument("--model", default="Qwen--Qwen2.5-VL-7B-Instruct")
    ap.add_argument("--images", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--backend", default="torchvision", choices=["pil", "torchvision"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=4.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree] or [("after", REPO_ROOT)]
    bundle = Path(args.model) if Path(args.model).is_dir() else MODELS_DIR / args.model
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for image in args.images:
        cell = results.setdefault(image, {name: [] for name, _ in trees})
        for r in range(args.rounds):
            order = trees if r % 2 == 0 else list(reversed(trees))
            for name, path in order:
                cell[name].append(run_tree(path, bundle, SIZES[image], args.min_time, args.backend))
    rows = []
    for image, cell in results.items():
        for name, _ in trees:
            runs = cell[name]
            rows.append([image, name, " / ".join(f"{x['rps']:.1f}" for x in runs), f"{median([x['rps'] for x in runs]):.1f}",
                         f"{median([x['cpu_ms'] for x in runs]):.1f}"])
        if len(trees) > 1:
            first, last = trees[0][0], trees[-1][0]
            ratio = median([b["rps"] / a["rps"] for a, b in zip(cell[first], cell[last])])
            rows.append([image, f"{last}/{first}", "", f"{ratio:.3f}", ""])
    print(f"model {bundle.name}, backend {args.backend}, {args.rounds} rounds x {args.min_time} s per tree")
    print(render_table(["image", "tree", "req/s per round", "median req/s", "CPU ms/req"], rows))
    if args.json:
        write_json(Path(args.json), {"model": bundle.name, "backend": args.backend, "results": results})


if __name__ == "__main__":
    main()
