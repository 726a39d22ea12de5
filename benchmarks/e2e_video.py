"""End to end, the video cell: mmgate against the Rust gateway ``smg`` on one clip, in front of the same null worker.

The image cells' benchmark (``benchmarks/e2e_gateway.py``) with a ``video_url`` part instead of an
image: one process (this one, the client) starts on loopback ``benchmarks/null_worker.py``, mmgate
(``mmgate.cli.launch.start_gateway``) and ``smg launch`` (``gateway_procs.start_smg``), both with
the same ``--multimodal-tensor-transport``.  The clip (default ``10s_30fps_1280x720``: 300 frames of
1280x720, libx264, made by ``benchmarks/video.py``'s ``make_clip`` into ``--clips-dir`` unless
already there) travels as a ``data:video/mp4;base64,`` URL with a short text, ``max_tokens`` 1.

Before timing the same request goes to both gateways: both must answer 200 with the **same**
``usage.prompt_tokens`` (Qwen3-VL samples the clip at 2 fps on both), and the worker's summary of
what each sent (tensor names, shapes, dtypes, transport) is printed; a difference stops the run.
Then a warm-up per gateway and ``--rounds`` rounds of ``--requests`` / rounds requests that
alternate which gateway goes first, a closed loop of ``c`` connections (``e2e_gateway.run_load``).
Reported per gateway: req/s, p50/p99, peak RSS of the process tree (VmRSS summed over the tree,
sampled every 20 ms while that gateway is measured; smg's ``ffmpeg`` children included while they
run), idle RSS, CPU ms per request of the tree (exited children included: :func:`tree_cpu_all`),
mmgate's stage medians, and the ratios mmgate/smg, with the load average before and after.

Run (about 2-3 minutes on 2 cores):
    python benchmarks/e2e_video.py --json bench-out/e2e-video.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from bench_report import MODELS_DIR, REPO_ROOT, environment, median, quantile, render_table, write_json
from e2e_gateway import DEFAULT_MODEL, WorkerLog, run_load
from gateway_procs import RssSampler, machine_busy, start_null_worker, start_smg, tree_cpu, tree_kb
from video import make_clip

from mmgate.cli.launch import Child, start_gateway, tree_pids

BENCH_OUT = REPO_ROOT / "bench-out"
#: name -> (seconds, fps, width, height, x264 options): the clip of issue 26
CLIPS = {"10s_30fps_1280x720": (10, 30, 1280, 720, {"preset": "veryfast", "crf": "23"})}
PROMPT_TEXT = "What happens in this video?"


def video_body(model: str, clip: bytes, max_tokens: int) -> bytes:
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    return json.dumps({"model": model, "max_tokens": max_tokens, "messages": [
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                     {"type": "text", "text": PROMPT_TEXT}]}]}).encode()


def clip_bytes(clips_dir: Path, name: str) -> bytes:
    path = clips_dir / f"{name}.mp4"
    if not path.is_file():
        clips_dir.mkdir(parents=True, exist_ok=True)
        make_clip(path, *CLIPS[name])
    return path.read_bytes()


def tree_cpu_all(pid: int) -> float:
    """CPU seconds of ``pid``'s process tree, including its children that have exited (``cutime`` +
    ``cstime``): smg decodes each clip in an ``ffmpeg`` child process, whose time would otherwise
    vanish from the tree when it exits between two readings."""
    total = tree_cpu(pid)[0]
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime
    return total


def validate(bases: dict[str, str], body: bytes, wlog: WorkerLog) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, base in bases.items():
        r = httpx.post(f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                       timeout=300)
        sent = wlog.new_lines()
        row[name] = {"status": r.status_code,
                     "prompt_tokens": r.json().get("usage", {}).get("prompt_tokens") if r.status_code == 200 else None,
                     "error": None if r.status_code == 200 else r.text[:300],
                     "worker_saw": [(t["name"], t["shape"], t["dtype"], t.get("transport"))
                                    for t in sent[0]["tensors"]] if sent else None}
        print(f"validate {name:6s}: {json.dumps(row[name])}")
    ok = all(v["status"] == 200 for v in row.values()) and len({v["prompt_tokens"] for v in row.values()}) == 1
    if not ok:
        raise SystemExit(f"validation failed: {json.dumps(row)[:2000]}")
    row["same_prompt_tokens"] = True
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    bundle = Path(args.model) if Path(args.model).is_dir() else MODELS_DIR / args.model
    org, sep, name = bundle.name.partition("--")
    served = f"{org}/{name}" if sep else bundle.name
    log_dir = BENCH_OUT / "e2e-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    clip = clip_bytes(Path(args.clips_dir), args.clip)
    body = video_body(served, clip, 1)
    transport = ["--multimodal-tensor-transport", args.transport, "--multimodal-shm-min-bytes", "65536"]
    shm_before = set(os.listdir("/dev/shm"))
    worker = start_null_worker(bundle, log_dir)
    children: dict[str, Child] = {}
    try:
        wlog = WorkerLog(worker.log_path) if worker.log_path else None
        assert wlog is not None
        children["mmgate"] = start_gateway(str(bundle), [worker.port], extra=[*transport, *args.mmgate_arg],
                                           log_dir=log_dir)
        children["smg"] = start_smg(Path(args.smg), bundle, worker.port, transport, log_dir, None, served)
        bases = {n: f"http://127.0.0.1:{c.port}" for n, c in children.items()}
        time.sleep(1.0)
        idle = {n: tree_kb(c.proc.pid, "VmRSS") / 1024 for n, c in children.items()}
        validation = validate(bases, video_body(served, clip, 2), wlog)  # max_tokens 2: the worker describes it
        cells: dict[str, dict[str, Any]] = {n: {"seconds": 0.0, "latencies": [], "errors": 0, "cpu_s": 0.0,
                                                "windows": [], "stages": {}, "worker_cpu_s": 0.0, "busy_s": 0.0,
                                                "total_s": 0.0} for n in children}
        load_before = os.getloadavg()
        with RssSampler({n: c.proc.pid for n, c in children.items()}) as sampler:
            for n, base in bases.items():
                asyncio.run(run_load(base, body, max(args.warmup, args.concurrency), args.concurrency))
            per_round = max(args.concurrency, args.requests // args.rounds)
            for rnd in range(args.rounds):
                for n in (list(bases) if rnd % 2 == 0 else list(reversed(bases))):
                    t0, cpu0 = time.monotonic(), tree_cpu_all(children[n].proc.pid)
                    wcpu0, busy0 = tree_cpu(worker.proc.pid)[0], machine_busy()
                    cell = cells[n]
                    secs, lats, errs = asyncio.run(run_load(bases[n], body, per_round, args.concurrency,
                                                            cell["stages"]))
                    cell["cpu_s"] += tree_cpu_all(children[n].proc.pid) - cpu0
                    busy1 = machine_busy()
                    cell["worker_cpu_s"] += tree_cpu(worker.proc.pid)[0] - wcpu0
                    cell["busy_s"] += busy1[0] - busy0[0]
                    cell["total_s"] += busy1[1] - busy0[1]
                    cell["windows"].append((t0, time.monotonic()))
                    cell["seconds"] += secs
                    cell["latencies"] += lats
                    cell["errors"] += errs
            peaks = {n: sampler.peak_kb(n, c["windows"]) / 1024 for n, c in cells.items()}
        load_after = os.getloadavg()
    finally:
        for c in children.values():
            c.stop()
        worker.stop()
    time.sleep(0.2)
    out = {}
    for n, c in cells.items():
        k = max(1, len(c["latencies"]))
        out[n] = {"requests": len(c["latencies"]), "errors": c["errors"], "rps": len(c["latencies"]) / c["seconds"],
                  "p50_ms": 1000 * median(c["latencies"]), "p99_ms": 1000 * quantile(c["latencies"], 0.99),
                  "peak_rss_mb": peaks[n], "idle_rss_mb": idle[n], "cpu_ms_per_request": 1000 * c["cpu_s"] / k,
                  "worker_cpu_ms_per_request": 1000 * c["worker_cpu_s"] / k,
                  "machine_busy_fraction": c["busy_s"] / c["total_s"] if c["total_s"] else None,
                  "stage_ms_median": {key: median(v) for key, v in c["stages"].items()}}
    return {"model": served, "clip": args.clip, "clip_bytes": len(clip), "transport": args.transport,
            "concurrency": args.concurrency, "validation": validation, "gateways": out,
            "loadavg_before": load_before, "loadavg_after": load_after,
            "dev_shm_leftovers": sorted(set(os.listdir("/dev/shm")) - shm_before)}


def table(result: dict[str, Any]) -> str:
    g = result["gateways"]
    m, s = g["mmgate"], g["smg"]
    return render_table(
        ["clip", "transport", "c", "prompt_tokens", "mmgate req/s", "smg req/s", "req/s mmgate/smg", "mmgate p50 ms",
         "smg p50 ms", "mmgate peak RSS MB", "smg peak RSS MB", "peak RSS mmgate/smg", "mmgate CPU ms/req",
         "smg CPU ms/req", "errors", "load 1m before/after"],
        [[result["clip"], result["transport"], result["concurrency"], result["validation"]["mmgate"]["prompt_tokens"],
          m["rps"], s["rps"], m["rps"] / s["rps"], m["p50_ms"], s["p50_ms"], m["peak_rss_mb"], s["peak_rss_mb"],
          m["peak_rss_mb"] / s["peak_rss_mb"], m["cpu_ms_per_request"], s["cpu_ms_per_request"],
          m["errors"] + s["errors"], f"{result['loadavg_before'][0]:.2f} {result['loadavg_after'][0]:.2f}"]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="bundle folder name under the models dir, or a path")
    ap.add_argument("--clip", default="10s_30fps_1280x720", choices=list(CLIPS))
    ap.add_argument("--clips-dir", default=str(BENCH_OUT / "clips"))
    ap.add_argument("--transport", default="inline", choices=["inline", "shm", "auto"])
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--requests", type=int, default=40, help="timed requests per gateway")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4, help="odd rounds run smg first")
    ap.add_argument("--smg", default=str(BENCH_OUT / "smg-venv" / "bin" / "smg"))
    ap.add_argument("--mmgate-arg", action="append", default=[], help="extra flag for mmgate serve (repeatable)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    env = environment()
    print(f"# e2e video  {env['date_utc']}  cpus={env['cpus']} load={env['loadavg_at_start']}")
    result = run(args)
    print(table(result))
    print(f"mmgate stage medians (ms): {result['gateways']['mmgate']['stage_ms_median']}")
    for name, g in result["gateways"].items():
        print(f"{name}: worker CPU {g['worker_cpu_ms_per_request']:.0f} ms/request, machine busy "
              f"{g['machine_busy_fraction']:.2f} during its rounds")
    print(f"/dev/shm leftovers: {len(result['dev_shm_leftovers'])}", file=sys.stderr)
    write_json(args.json, {"benchmark": "e2e_video", "env": env, "args": vars(args), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
