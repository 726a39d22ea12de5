"""End to end: mmgate against the Rust gateway ``smg`` in front of the same null worker.

One process (this one, the client) starts, on loopback:

* ``benchmarks/null_worker.py``: a vLLM-wire gRPC worker that answers at once
  (reads and unlinks shm payloads, then one token), so the gateways are measured;
* mmgate: ``python -m mmgate.cli serve --model <bundle> --worker-urls grpc://... --log-level warning``
  (``mmgate.cli.launch.start_gateway``), plus ``--multimodal-tensor-transport`` /
  ``--multimodal-shm-min-bytes`` when this mmgate has them;
* smg: ``smg launch --worker-urls grpc://... --model-path <bundle>`` from its own
  virtual environment (``--smg``; default ``bench-out/smg-venv/bin/smg``, made with
  ``python3 -m venv bench-out/smg-venv && bench-out/smg-venv/bin/pip install smg==1.13.0``).
  ``libturbojpeg.so.0`` is put on smg's ``LD_LIBRARY_PATH`` from ``--turbojpeg-dir``
  when present, so smg decodes JPEGs like Pillow (without it smg warns and uses a
  pure-Rust decoder).

Before timing, the same request goes to both gateways: both must answer 200 with
the same ``usage.prompt_tokens``, and the worker's one-line summary of what each
sent (tensor shapes, dtypes, transport) is printed.  Then, per (image, concurrency):
a warm-up, then a fixed number of chat requests (one JPEG as a data URL + short
text, ``max_tokens`` 1), split in ``--rounds`` rounds that alternate which gateway
goes first, from an ``httpx.AsyncClient`` pool of ``c`` connections (closed loop).
Reported: requests/s, p50/p99 latency, the peak RSS of each gateway's process
tree (``/proc/<pid>/status`` VmRSS summed over the tree, sampled every 20 ms
while it is measured; idle RSS once both are ready, before any request; lifetime VmHWM at the end),
and the ratios mmgate/smg.

Run (each invocation stays under about 5 minutes on 2 cores):
    python benchmarks/e2e_gateway.py --transport inline shm --images 640x480 --json bench-out/e2e-640.json
    python benchmarks/e2e_gateway.py --transport inline shm --images 1280x960 --requests-c1 60 --requests-c8 120 \
        --json bench-out/e2e-1280.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench_report import MODELS_DIR, REPO_ROOT, SIZES, environment, median, quantile, render_table, sample_jpeg, write_json
from gateway_procs import (
    RssSampler,
    machine_busy,
    mmgate_has_transport_flags,
    start_null_worker,
    start_smg,
    tree_cpu,
    tree_kb,
)

from mmgate.cli.launch import Child, start_gateway

BENCH_OUT = REPO_ROOT / "bench-out"
DEFAULT_MODEL = "Qwen--Qwen3-VL-2B-Instruct"
PROMPT_TEXT = "Describe this picture in one word."
GATEWAYS = ("mmgate", "smg")


# ---------------------------------------------------------------- client


def chat_body(model: str, jpeg: bytes, max_tokens: int, stream: bool = False) -> bytes:
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    return json.dumps({"model": model, "max_tokens": max_tokens, "stream": stream, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": PROMPT_TEXT}]}]}).encode()


STAGE_HEADER = "x-mmgate-stage-ms"


def parse_stages(value: str | None) -> dict[str, float]:
    """``X-Mmgate-Stage-Ms: plan=0.05,render=1.20,...`` -> {stage: ms}."""
    out: dict[str, float] = {}
    for item in (value or "").split(","):
        key, _, ms = item.partition("=")
        try:
            out[key.strip()] = float(ms)
        except ValueError:
            continue
    return out


async def run_load(base: str, body: bytes, n: int, concurrency: int,
                   stages: dict[str, list[float]] | None = None) -> tuple[float, list[float], int]:
    """Closed loop: ``concurrency`` in flight until ``n`` requests are done; (seconds, latencies s, non-200s).

    ``stages``: when given, mmgate's per-stage timings (response header) are appended to it.
    """
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    latencies: list[float] = []
    errors = 0
    issued = 0
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120.0) as client:
        async def one_worker() -> None:
            nonlocal issued, errors
            while issued < n:
                issued += 1
                t0 = time.perf_counter()
                r = await client.post("/v1/chat/completions", content=body, headers=headers)
                await r.aread()
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors += 1
                if stages is not None and STAGE_HEADER in r.headers:
                    for key, ms in parse_stages(r.headers[STAGE_HEADER]).items():
                        stages.setdefault(key, []).append(ms)

        t_start = time.perf_counter()
        await asyncio.gather(*(one_worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t_start
    return elapsed, latencies, errors


def probe(base: str, body: bytes, stream_body: bytes) -> dict[str, Any]:
    r = httpx.post(f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                   timeout=120)
    out: dict[str, Any] = {"status": r.status_code}
    try:
        data = r.json()
        out["prompt_tokens"] = data.get("usage", {}).get("prompt_tokens")
        out["content"] = data.get("choices", [{}])[0].get("message", {}).get("content")
        if r.status_code != 200:
            out["error"] = data
    except ValueError:
        out["error"] = r.text[:300]
    s = httpx.post(f"{base}/v1/chat/completions", content=stream_body, headers={"content-type": "application/json"},
                   timeout=120)
    out["stream_status"] = s.status_code
    out["stream_done"] = s.text.rstrip().endswith("data: [DONE]")
    return out


class WorkerLog:
    """Reads the null worker's DESCRIBE lines appended since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def new_lines(self) -> list[dict[str, Any]]:
        time.sleep(0.05)
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        return [json.loads(line[len("DESCRIBE "):]) for line in chunk.decode(errors="replace").splitlines()
                if line.startswith("DESCRIBE ")]


# ---------------------------------------------------------------- benchmark


def main_thread_cpu(pid: int) -> float:
    """CPU seconds (user + system) of ``pid``'s main thread: for a single mmgate process, its event loop."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class CellResult:
    image: str
    concurrency: int
    requests: int
    gateway: str
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    windows: list[tuple[float, float]] = field(default_factory=list)
    peak_rss_mb: float = float("nan")
    cpu_s: float = 0.0  # CPU time (user + system) of the gateway's process tree during the timed rounds
    main_thread_cpu_s: float = 0.0  # of its main thread (mmgate: the event loop)
    minor_faults: int = 0
    worker_cpu_s: float = 0.0  # CPU time of the null worker during this gateway's rounds
    machine_busy_s: float = 0.0  # busy CPU time of the whole machine during this gateway's rounds
    machine_total_s: float = 0.0
    stages: dict[str, list[float]] = field(default_factory=dict)  # mmgate only: stage -> ms per request
    loadavg: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the machine's load average when the cell began

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else float("nan")

    def summary(self) -> dict[str, Any]:
        return {"image": self.image, "concurrency": self.concurrency, "gateway": self.gateway,
                "requests": len(self.latencies), "errors": self.errors, "seconds": round(self.seconds, 3),
                "rps": self.rps, "p50_ms": 1000 * median(self.latencies),
                "p99_ms": 1000 * quantile(self.latencies, 0.99), "peak_rss_mb": self.peak_rss_mb,
                "cpu_ms_per_request": 1000 * self.cpu_s / max(1, len(self.latencies)),
                "main_thread_cpu_ms_per_request": 1000 * self.main_thread_cpu_s / max(1, len(self.latencies)),
                "minor_faults_per_request": self.minor_faults / max(1, len(self.latencies)),
                "worker_cpu_ms_per_request": 1000 * self.worker_cpu_s / max(1, len(self.latencies)),
                "machine_busy_fraction": self.machine_busy_s / self.machine_total_s if self.machine_total_s else None,
                "stage_ms_median": {k: median(v) for k, v in self.stages.items()},
                "loadavg_at_start": [round(x, 2) for x in self.loadavg]}


def validate(bases: dict[str, str], model: str, jpegs: dict[str, bytes], wlog: WorkerLog,
             strict: bool) -> list[dict[str, Any]]:
    """Same request to every gateway: 200, same prompt_tokens, and what the worker received."""
    report = []
    for size, jpeg in jpegs.items():
        row: dict[str, Any] = {"image": size}
        for name, base in bases.items():
            row[name] = probe(base, chat_body(model, jpeg, 2), chat_body(model, jpeg, 2, stream=True))
            sent = wlog.new_lines()
            row[name]["worker_saw"] = sent[0] if sent else None
            print(f"validate {size} {name:6s}: status {row[name]['status']} prompt_tokens "
                  f"{row[name].get('prompt_tokens')} stream {row[name]['stream_status']}"
                  f"{'' if row[name]['stream_done'] else ' (no [DONE])'}  worker saw "
                  f"{json.dumps(row[name]['worker_saw']['tensors'] if row[name]['worker_saw'] else None)}")
            if row[name]["status"] != 200:
                print(f"  error: {row[name].get('error')}")
        names = list(bases)
        ok = all(row[n]["status"] == 200 and row[n]["stream_status"] == 200 for n in names) and \
            len({row[n].get("prompt_tokens") for n in names}) == 1
        shapes = {json.dumps([(t["name"], t["shape"], t["dtype"]) for t in row[n]["worker_saw"]["tensors"]])
                  for n in names if row[n]["worker_saw"]}
        row["same_prompt_tokens_and_status"] = ok
        row["same_tensor_shapes"] = len(shapes) == 1
        if not ok or len(shapes) != 1:
            msg = f"validation failed for {size}: {json.dumps(row, default=str)[:2000]}"
            if strict:
                raise SystemExit(msg)
            print("WARNING " + msg)
        report.append(row)
    return report


def variants(args: argparse.Namespace) -> list[tuple[str, list[str], dict[str, str]]]:
    """``--mmgate-variant LABEL:[KEY=VALUE ...] FLAGS`` -> [(LABEL, [flag, ...], {KEY: VALUE})]: leading
    ``KEY=VALUE`` words set the variant's environment (e.g. ``PYTHONPATH=/tmp/before/src``: another tree)."""
    out = []
    for spec in args.mmgate_variant:
        label, _, flags = spec.partition(":")
        words = shlex.split(flags)
        env: dict[str, str] = {}
        while words and "=" in words[0] and not words[0].startswith("-"):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        out.append((label.strip(), words, env))
    return out


def run_transport(args: argparse.Namespace, transport: str, bundle: Path, served: str, jpegs: dict[str, bytes],
                  mmgate_flags: bool, log_dir: Path) -> dict[str, Any]:
    shm_before = set(os.listdir("/dev/shm"))
    worker = start_null_worker(bundle, log_dir)
    children: dict[str, Child] = {}
    transport_args = ["--multimodal-tensor-transport", transport]
    if args.shm_min_bytes is not None:
        transport_args += ["--multimodal-shm-min-bytes", str(args.shm_min_bytes)]
    run_mmgate = mmgate_flags or transport == "inline"
    spy: subprocess.Popen[bytes] | None = None
    try:
        wlog = WorkerLog(worker.log_path) if worker.log_path else None
        if run_mmgate:
            extra = [*(transport_args if mmgate_flags else []), *args.mmgate_arg]
            mmgate_env = dict(os.environ) | dict(kv.split("=", 1) for kv in args.mmgate_env) if args.mmgate_env else None
            children["mmgate"] = start_gateway(str(bundle), [worker.port], extra=extra, log_dir=log_dir,
                                               env=mmgate_env)
            for label, variant_args, variant_env in variants(args):  # other flags or tree, same rounds
                env = (mmgate_env or dict(os.environ)) | variant_env if variant_env else mmgate_env
                children[f"mmgate:{label}"] = start_gateway(str(bundle), [worker.port], extra=[*extra, *variant_args],
                                                            log_dir=log_dir, env=env)
        children["smg"] = start_smg(Path(args.smg), bundle, worker.port, transport_args, log_dir,
                                    Path(args.turbojpeg_dir) if args.turbojpeg_dir else None, served)
        bases = {n: f"http://127.0.0.1:{c.port}" for n, c in children.items()}
        time.sleep(1.0)  # both ready: idle RSS before any request
        idle = {n: tree_kb(c.proc.pid, "VmRSS") / 1024 for n, c in children.items()}
        print(f"[{transport}] idle RSS MB: " + "  ".join(f"{n} {v:.0f}" for n, v in idle.items()), file=sys.stderr)
        assert wlog is not None
        validation = validate(bases, served, jpegs, wlog, strict=not args.no_strict)
        if args.validate_only:
            return {"transport": transport, "mmgate_ran": run_mmgate, "mmgate_transport_flags": mmgate_flags,
                    "validation": validation, "cells": [], "vmhwm_mb": {}, "idle_rss_mb": idle, "dev_shm_leftovers": []}
        if args.py_spy and "mmgate" in children:
            spy_out = log_dir / f"mmgate-{transport}.pyspy.txt"
            spy = subprocess.Popen([args.py_spy, "record", "--pid", str(children["mmgate"].proc.pid), "--rate", "200",
                                    "--format", "raw", "--threads", "--nonblocking", "--output", str(spy_out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results: list[CellResult] = []
        with RssSampler({n: c.proc.pid for n, c in children.items()}) as sampler:
            for size, jpeg in jpegs.items():
                body = chat_body(served, jpeg, 1)
                for conc in args.concurrency:
                    n_total = args.requests_c1 if conc == 1 else max(conc, args.requests_c8 * conc // 8)
                    cells = {n: CellResult(size, conc, n_total, n, loadavg=os.getloadavg()) for n in children}
                    for name, base in bases.items():  # warm-up, not counted
                        asyncio.run(run_load(base, body, max(args.warmup, conc), conc))
                    per_round = max(1, n_total // args.rounds)
                    for rnd in range(args.rounds):
                        names = list(bases)  # rotated: each gateway goes first in turn (2: alternate)
                        order = names[rnd % len(names):] + names[:rnd % len(names)]
                        for name in order:
                            t0 = time.monotonic()
                            cpu0, faults0 = tree_cpu(children[name].proc.pid)
                            loop0 = main_thread_cpu(children[name].proc.pid)
                            wcpu0, busy0 = tree_cpu(worker.proc.pid)[0], machine_busy()
                            secs, lats, errs = asyncio.run(run_load(bases[name], body, per_round, conc,
                                                                    cells[name].stages))
                            cpu1, faults1 = tree_cpu(children[name].proc.pid)
                            cells[name].main_thread_cpu_s += main_thread_cpu(children[name].proc.pid) - loop0
                            wcpu1, busy1 = tree_cpu(worker.proc.pid)[0], machine_busy()
                            cells[name].cpu_s += cpu1 - cpu0
                            cells[name].minor_faults += faults1 - faults0
                            cells[name].worker_cpu_s += wcpu1 - wcpu0
                            cells[name].machine_busy_s += busy1[0] - busy0[0]
                            cells[name].machine_total_s += busy1[1] - busy0[1]
                            cells[name].windows.append((t0, time.monotonic()))
                            cells[name].seconds += secs
                            cells[name].latencies += lats
                            cells[name].errors += errs
                    for name, cell in cells.items():
                        cell.peak_rss_mb = sampler.peak_kb(name, cell.windows) / 1024
                        results.append(cell)
                    line = "  ".join(f"{n} {c.rps:.1f} req/s p50 {1000 * median(c.latencies):.1f} ms"
                                     for n, c in cells.items())
                    print(f"[{transport}] {size} c={conc}: {line}", file=sys.stderr)
        hwm = {n: tree_kb(c.proc.pid, "VmHWM") / 1024 for n, c in children.items()}
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=30)
            print(f"py-spy collapsed stacks of mmgate ({transport}): {spy_out}")
    finally:
        for c in children.values():
            c.stop()
        worker.stop()
    time.sleep(0.2)
    leaked = sorted(set(os.listdir("/dev/shm")) - shm_before)
    return {"transport": transport, "mmgate_ran": run_mmgate, "mmgate_transport_flags": mmgate_flags,
            "validation": validation, "cells": [c.summary() for c in results], "vmhwm_mb": hwm,
            "idle_rss_mb": idle, "dev_shm_leftovers": leaked}


def table(phases: list[dict[str, Any]]) -> str:
    headers = ["transport", "image", "c", "mmgate req/s", "smg req/s", "mmgate p50 ms", "smg p50 ms",
               "mmgate p99 ms", "smg p99 ms", "mmgate peak RSS MB", "smg peak RSS MB",
               "mmgate CPU ms/req", "smg CPU ms/req", "mmgate loop CPU ms/req",
               "req/s mmgate/smg", "p50 mmgate/smg", "p99 mmgate/smg", "RSS mmgate/smg", "CPU/req mmgate/smg"]
    rows = []
    for ph in phases:
        by = {(c["image"], c["concurrency"], c["gateway"]): c for c in ph["cells"]}
        keys = sorted({(c["image"], c["concurrency"]) for c in ph["cells"]}, key=lambda k: (SIZES[k[0]], k[1]))
        names = sorted({c["gateway"] for c in ph["cells"] if c["gateway"] != "smg"} or {"mmgate"})
        for (image, conc), gw in [(k, g) for k in keys for g in names]:
            s = by[(image, conc, "smg")]
            m = by.get((image, conc, gw))
            if m is None:
                pending = "pending"
                rows.append([ph["transport"], image, conc, pending, s["rps"], pending, s["p50_ms"], pending,
                             s["p99_ms"], pending, s["peak_rss_mb"], pending, s["cpu_ms_per_request"], pending,
                             pending, pending, pending, pending, pending])
                continue
            label = ph["transport"] if gw == "mmgate" else f"{ph['transport']} ({gw})"
            rows.append([label, image, conc, m["rps"], s["rps"], m["p50_ms"], s["p50_ms"], m["p99_ms"],
                         s["p99_ms"], m["peak_rss_mb"], s["peak_rss_mb"], m["cpu_ms_per_request"],
                         s["cpu_ms_per_request"], m["main_thread_cpu_ms_per_request"], m["rps"] / s["rps"], m["p50_ms"] / s["p50_ms"],
                         m["p99_ms"] / s["p99_ms"], m["peak_rss_mb"] / s["peak_rss_mb"],
                         m["cpu_ms_per_request"] / s["cpu_ms_per_request"]])
    return render_table(headers, rows)


def stage_table(phases: list[dict[str, Any]]) -> str:
    """Median mmgate stage timings (ms) per cell, from its X-Mmgate-Stage-Ms header."""
    names: list[str] = []
    rows = []
    for ph in phases:
        for c in ph["cells"]:
            if c["gateway"] != "mmgate" or not c["stage_ms_median"]:
                continue
            names += [k for k in c["stage_ms_median"] if k not in names]
    for ph in phases:
        for c in ph["cells"]:
            if c["gateway"] == "mmgate" and c["stage_ms_median"]:
                st = c["stage_ms_median"]
                rows.append([ph["transport"], c["image"], c["concurrency"], *[st.get(k, float("nan")) for k in names],
                             c["p50_ms"]])
    return render_table(["transport", "image", "c", *names, "client p50"], rows) if rows else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="bundle folder name under the models dir, or a path")
    ap.add_argument("--transport", nargs="+", default=["inline"], choices=["inline", "shm", "auto"])
    ap.add_argument("--shm-min-bytes", type=int, default=65536, help="--multimodal-shm-min-bytes for both gateways")
    ap.add_argument("--images", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--requests-c1", type=int, default=200, help="timed requests per gateway at c=1")
    ap.add_argument("--requests-c8", type=int, default=400,
                    help="timed requests per gateway at c=8 (scaled by c/8 for other c > 1)")
    ap.add_argument("--warmup", type=int, default=16, help="untimed requests per gateway per cell")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per cell; odd rounds run smg first")
    ap.add_argument("--smg", default=str(BENCH_OUT / "smg-venv" / "bin" / "smg"))
    ap.add_argument("--turbojpeg-dir", default=str(BENCH_OUT / "turbojpeg" / "usr" / "lib" / "x86_64-linux-gnu"),
                    help="folder holding libturbojpeg.so.0 for smg ('' to run smg without it)")
    ap.add_argument("--mmgate-arg", action="append", default=[], help="extra flag for mmgate serve (repeatable)")
    ap.add_argument("--mmgate-variant", action="append", default=[], metavar="LABEL:[KEY=VALUE ...] FLAGS",
                    help="also run mmgate with these extra flags (shell-split; leading KEY=VALUE words: its "
                         "environment, e.g. PYTHONPATH=<other tree>/src) as gateway mmgate:LABEL, in the same "
                         "rounds (an A/B of a flag or a tree in the same minute); repeatable")
    ap.add_argument("--mmgate-env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment variable for mmgate serve only (repeatable)")
    ap.add_argument("--py-spy", default=None,
                    help="py-spy binary: record mmgate's stacks during the timed part (raw collapsed stacks in bench-out/e2e-logs)")
    ap.add_argument("--validate-only", action="store_true", help="start, validate, stop (no timing)")
    ap.add_argument("--no-strict", action="store_true", help="time even if the validation finds a difference")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    bundle = Path(args.model) if Path(args.model).is_dir() else MODELS_DIR / args.model
    org, sep, name = bundle.name.partition("--")
    served = f"{org}/{name}" if sep else bundle.name  # what both gateways list in /v1/models
    if not Path(args.smg).exists():
        raise SystemExit(f"smg not found at {args.smg}: python3 -m venv bench-out/smg-venv && "
                         "bench-out/smg-venv/bin/pip install smg==1.13.0")
    log_dir = BENCH_OUT / "e2e-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    mmgate_flags = mmgate_has_transport_flags()
    env = environment() | {"model": str(bundle), "served_model_name": served, "mmgate_transport_flags": mmgate_flags,
                           "smg_version": subprocess.run([args.smg, "--version"], capture_output=True,
                                                         text=True).stdout.strip() or "1.13.0"}
    print(f"# e2e gateway benchmark  {env['date_utc']}  cpus={env['cpus']} load={env['loadavg_at_start']}  "
          f"model={served}  mmgate transport flags: {'yes' if mmgate_flags else 'no (shm rows pending)'}")
    jpegs = {s: sample_jpeg(*SIZES[s], seed=7) for s in args.images}
    t0 = time.perf_counter()
    phases = [run_transport(args, t, bundle, served, jpegs, mmgate_flags, log_dir) for t in args.transport]
    print()
    print(table(phases))
    stages = stage_table(phases)
    if stages:
        print("\nmmgate stage medians (ms, X-Mmgate-Stage-Ms):")
        print(stages)
    for ph in phases:
        print(f"{ph['transport']}: idle RSS MB {ph['idle_rss_mb']}; lifetime VmHWM MB {ph['vmhwm_mb']}; "
              f"/dev/shm leftovers: {len(ph['dev_shm_leftovers'])}")
    print(f"total {time.perf_counter() - t0:.0f}s.  ratios: mmgate/smg (req/s > 1: mmgate faster; "
          "latency and RSS < 1: mmgate better)")
    write_json(args.json, {"benchmark": "e2e_gateway", "env": env, "args": vars(args), "phases": phases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
