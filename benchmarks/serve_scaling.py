"""``mmgate serve --workers N``: requests/s and CPU per request at N = 1, 2, 4, 8 and of smg, in front of the null worker.

One process (this one, the client) starts, on loopback:

* ``benchmarks/null_worker.py``: a vLLM-wire gRPC worker that answers at once, so the gateways are measured;
* one mmgate per ``--processes`` value (default 1, 2, 4, 8), all up for the whole run
  (``mmgate.cli.launch.start_gateway``, ``--log-level warning``): ``mmgate serve --workers 1`` (the default:
  one process) and ``mmgate serve --workers N`` (a parent and N gateway processes on one port, ``SO_REUSEPORT``);
* the Rust gateway ``smg launch`` 1.13 (``gateway_procs.start_smg``, ``--smg``; it uses every core by default),
  in front of the same worker (``--no-smg``: without it).

Nothing depends on the machine's core count: the same command runs on 2 or 16 cores (the load average and
the machine's busy share are reported per cell).

Before timing, each gateway gets the same request per image: both must answer 200 with the same
``usage.prompt_tokens``.  Then per image (one JPEG as a data URL + short text, ``max_tokens`` 1, the body of
``benchmarks/e2e_gateway.py``): a warm-up per gateway, then ``--rounds`` rounds that alternate which gateway
goes first, each a closed loop of ``c`` connections (``e2e_gateway.run_load``: a new ``httpx.AsyncClient``
per round, so each round's ``c`` connections are spread over the processes anew).  Reported per (image, N):
requests/s, p50/p99, CPU ms per request of the gateway's whole process tree (``gateway_procs.tree_cpu``),
split by thread kind (the event-loop thread of each process; the other Python threads, i.e. the
preprocessing pool; gRPC's C-core threads), each process's share of the tree's CPU (how evenly the kernel
spread the connections), how busy the whole machine was, and the load average before and after each cell.
The split says what a preprocessing process pool could take off the event loop (only the pool's share)
and what stays serial in one process (docs/performance.md, "Many cores").

Run (about 2-3 minutes on 2 cores with --requests 240):
    python benchmarks/serve_scaling.py --json bench-out/serve-scaling.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_report import (
    MODELS_DIR,
    REPO_ROOT,
    SIZES,
    environment,
    median,
    quantile,
    render_table,
    sample_jpeg,
    write_json,
)
from e2e_gateway import DEFAULT_MODEL, chat_body, run_load
from gateway_procs import machine_busy, start_null_worker, start_smg, tree_cpu

from mmgate.cli.launch import Child, start_gateway, tree_pids

BENCH_OUT = REPO_ROOT / "bench-out"
_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s process tree by thread kind, plus ``pid:<n>`` per process.

    ``loop``: each process's main thread (the asyncio event loop); ``grpc``: threads gRPC's C core named
    (``event_engine``, ``grpc_global_tim``, ...); ``pool``: the other threads (Python threads: the
    preprocessing pool, the trimmer).
    """
    out = {"loop": 0.0, "grpc": 0.0, "pool": 0.0}
    for p in tree_pids(pid):
        try:
            tasks = os.listdir(f"/proc/{p}/task")
            with open(f"/proc/{p}/comm") as f:
                main_comm = f.read().strip()
        except OSError:
            continue
        total = 0.0
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/comm") as f:
                    comm = f.read().strip()
                with open(f"/proc/{p}/task/{t}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            cpu = (int(fields[11]) + int(fields[12])) / _TICK
            total += cpu
            kind = "loop" if int(t) == p else ("pool" if comm == main_comm else "grpc")
            out[kind] += cpu
        out[f"pid:{p}"] = total
    return out


@dataclass
class Cell:
    image: str
    processes: int  # 0: smg
    concurrency: int
    root_pid: int  # the gateway's first process (with --workers N > 1: the supervising parent)
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    cpu_s: float = 0.0
    threads: dict[str, float] = field(default_factory=dict)  # kind -> CPU seconds during the timed rounds
    busy_s: float = 0.0
    total_s: float = 0.0
    load_before: tuple[float, ...] = ()
    load_after: tuple[float, ...] = ()

    def summary(self) -> dict[str, Any]:
        n = max(1, len(self.latencies))
        per_process = {k: v for k, v in self.threads.items() if k.startswith("pid:")}
        spread = sum(per_process.values()) or 1.0
        return {"image": self.image, "gateway": label(self.processes), "processes": self.processes,
                "concurrency": self.concurrency,
                "requests": len(self.latencies), "errors": self.errors, "seconds": round(self.seconds, 3),
                "rps": len(self.latencies) / self.seconds if self.seconds else float("nan"),
                "p50_ms": 1000 * median(self.latencies), "p99_ms": 1000 * quantile(self.latencies, 0.99),
                "cpu_ms_per_request": 1000 * self.cpu_s / n,
                "thread_cpu_ms_per_request": {k: 1000 * self.threads.get(k, 0.0) / n for k in ("loop", "pool", "grpc")},
                "process_cpu_share": sorted((round(v / spread, 3) for k, v in per_process.items()
                                             if self.processes <= 1 or k != f"pid:{self.root_pid}"), reverse=True),
                "supervisor_cpu_ms_per_request": (1000 * per_process.get(f"pid:{self.root_pid}", 0.0) / n
                                                  if self.processes > 1 else 0.0),
                "machine_busy_fraction": self.busy_s / self.total_s if self.total_s else None,
                "loadavg_before": self.load_before, "loadavg_after": self.load_after}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def label(processes: int) -> str:
    """``N=4`` for ``mmgate serve --workers 4``, ``smg`` for the Rust gateway (processes 0)."""
    return f"N={processes}" if processes else "smg"


def _validate(gateways: dict[int, Child], served: str, jpegs: dict[str, bytes]) -> list[dict[str, Any]]:
    rows = []
    for size, jpeg in jpegs.items():
        row: dict[str, Any] = {"image": size}
        for n, child in gateways.items():
            r = httpx.post(f"http://127.0.0.1:{child.port}/v1/chat/completions", content=chat_body(served, jpeg, 1),
                           headers={"content-type": "application/json"}, timeout=120)
            row[label(n)] = {"status": r.status_code,
                             "prompt_tokens": r.json().get("usage", {}).get("prompt_tokens") if r.status_code == 200
                             else None}
        answers = [v for k, v in row.items() if k != "image"]
        row["same"] = len({(v["status"], v["prompt_tokens"]) for v in answers}) == 1
        print(f"validate {size}: {row}")
        if not row["same"] or any(v["status"] != 200 for v in answers):
            raise SystemExit(f"validation failed: {row}")
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    bundle = Path(args.model) if Path(args.model).is_dir() else MODELS_DIR / args.model
    org, sep, name = bundle.name.partition("--")
    served = f"{org}/{name}" if sep else bundle.name
    log_dir = BENCH_OUT / "e2e-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    jpegs = {s: sample_jpeg(*SIZES[s], seed=7) for s in args.images}
    shm_before = set(os.listdir("/dev/shm"))
    worker = start_null_worker(bundle, log_dir)
    gateways: dict[int, Child] = {}
    cells: list[Cell] = []
    try:
        for n in args.processes:
            gateways[n] = start_gateway(str(bundle), [worker.port], extra=list(args.mmgate_arg), log_dir=log_dir,
                                        processes=n)
        if not args.no_smg:
            gateways[0] = start_smg(Path(args.smg), bundle, worker.port, [], log_dir, None, served)
        validation = _validate(gateways, served, jpegs)
        for size, jpeg in jpegs.items():
            body = chat_body(served, jpeg, 1)
            for conc in args.concurrency:
                by_n = {n: Cell(size, n, conc, c.proc.pid, load_before=os.getloadavg()) for n, c in gateways.items()}
                for child in gateways.values():
                    asyncio.run(run_load(f"http://127.0.0.1:{child.port}", body, args.warmup, conc))
                per_round = max(conc, args.requests // args.rounds)
                for rnd in range(args.rounds):
                    order = list(gateways) if rnd % 2 == 0 else list(reversed(gateways))
                    for n in order:
                        child, cell = gateways[n], by_n[n]
                        cpu0, th0, busy0 = tree_cpu(child.proc.pid)[0], thread_cpu(child.proc.pid), machine_busy()
                        secs, lats, errs = asyncio.run(run_load(f"http://127.0.0.1:{child.port}", body, per_round,
                                                                conc))
                        cpu1, th1, busy1 = tree_cpu(child.proc.pid)[0], thread_cpu(child.proc.pid), machine_busy()
                        cell.cpu_s += cpu1 - cpu0
                        for k, v in _delta(th1, th0).items():
                            cell.threads[k] = cell.threads.get(k, 0.0) + v
                        cell.busy_s += busy1[0] - busy0[0]
                        cell.total_s += busy1[1] - busy0[1]
                        cell.seconds += secs
                        cell.latencies += lats
                        cell.errors += errs
                for cell in by_n.values():
                    cell.load_after = os.getloadavg()
                    cells.append(cell)
                print(f"{size} c={conc}: " + "  ".join(
                    f"{label(n)} {len(c.latencies) / c.seconds:.1f} req/s p50 {1000 * median(c.latencies):.0f} ms"
                    for n, c in by_n.items()), file=sys.stderr)
    finally:
        for child in gateways.values():
            child.stop()
        worker.stop()
    time.sleep(0.3)
    return {"model": served, "validation": validation, "cells": [c.summary() for c in cells],
            "dev_shm_leftovers": sorted(set(os.listdir("/dev/shm")) - shm_before)}


def table(result: dict[str, Any]) -> str:
    rows = []
    base = {(c["image"], c["concurrency"]): c for c in result["cells"] if c["processes"] == 1}
    smg = {(c["image"], c["concurrency"]): c for c in result["cells"] if c["processes"] == 0}
    for c in result["cells"]:
        one = base.get((c["image"], c["concurrency"]))
        rust = smg.get((c["image"], c["concurrency"]))
        th = c["thread_cpu_ms_per_request"]
        rows.append([c["image"], c["concurrency"], label(c["processes"]), c["rps"],
                     c["rps"] / one["rps"] if one else float("nan"),
                     c["rps"] / rust["rps"] if rust else float("nan"), c["p50_ms"], c["p99_ms"],
                     c["cpu_ms_per_request"], th["loop"], th["pool"], th["grpc"],
                     " / ".join(f"{s:.2f}" for s in c["process_cpu_share"]),
                     c["machine_busy_fraction"] or float("nan"), c["errors"],
                     " ".join(f"{v:.2f}" for v in c["loadavg_before"][:1] + c["loadavg_after"][:1])])
    return render_table(["image", "c", "gateway", "req/s", "req/s vs N=1", "req/s vs smg", "p50 ms", "p99 ms", "CPU ms/req",
                         "loop ms/req", "pool ms/req", "grpc ms/req", "process CPU share", "machine busy",
                         "errors", "load 1m before/after"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="bundle folder name under the models dir, or a path")
    ap.add_argument("--images", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--processes", nargs="+", type=int, default=[1, 2, 4, 8], help="--workers values compared")
    ap.add_argument("--smg", default=str(BENCH_OUT / "smg-venv" / "bin" / "smg"), help="the Rust gateway's binary")
    ap.add_argument("--no-smg", action="store_true", help="compare mmgate's process counts only")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[8])
    ap.add_argument("--requests", type=int, default=320, help="timed requests per gateway per cell")
    ap.add_argument("--warmup", type=int, default=24, help="untimed requests per gateway per cell")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per cell; odd rounds reverse the order")
    ap.add_argument("--mmgate-arg", action="append", default=[], help="extra flag for both gateways (repeatable)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    env = environment()
    print(f"# serve --workers scaling  {env['date_utc']}  cpus={env['cpus']} load={env['loadavg_at_start']}")
    t0 = time.perf_counter()
    result = run(args)
    print()
    print(table(result))
    print(f"total {time.perf_counter() - t0:.0f}s; /dev/shm leftovers: {len(result['dev_shm_leftovers'])}; "
          f"load average at the end {[round(v, 2) for v in os.getloadavg()]}")
    write_json(args.json, {"benchmark": "serve_scaling", "env": env | {"loadavg_at_end": os.getloadavg()},
                           "args": vars(args), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
