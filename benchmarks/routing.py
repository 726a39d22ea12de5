"""Routing benchmark: prompt-token cache-hit ratio and load spread per policy, mmgate against smg 1.13.

One process (this one, the client) starts, on loopback:

* ``benchmarks/recording_worker.py``: four vLLM-wire workers in one process, each simulating a
  prefix cache (an LRU of ``--capacity-blocks`` blocks of 16 tokens of the expanded prompt; a block
  holding media placeholders is keyed by the item's content, so two different images never share
  a block; see ``routing_sim.py``) and counting the prompt tokens it received and those it served
  from its cache;
* per policy, mmgate (``mmgate serve --model <bundle> --worker-urls <4 workers> --policy P``) and
  smg (``smg launch --worker-urls <the same 4> --model-path <bundle> --policy P --mm-processing router``,
  from its own virtual environment, ``--smg``; made with ``python3 -m venv bench-out/smg-venv &&
  bench-out/smg-venv/bin/pip install smg==1.13.0``), one after the other, the workers' caches and
  counters reset before each run.

The trace (``routing_sim.make_trace``, seeded: the same requests every run) is a set of multi-turn
conversations: shared system prompts, one image, two images or a short video clip in the first user
message (a few hot images shared by many users), then follow-up turns about the same media, each turn
appending the trace's assistant answer and a new question.  Media are generated (JPEG, H.264 MP4)
and sent as ``data:`` URLs.  ``--concurrency`` conversations are in flight at once (each one's turns in
order, the next turn after the previous answer), through the chat completions API, with
``X-SMG-Routing-Key: <user>`` (the session key of smg's consistent_hashing) and ``user``.

Reported per (policy, gateway): requests, errors, prompt tokens (the gateway's ``usage`` and the
workers' count), cached tokens, the hit ratio (cached / prompt tokens over all workers), requests
per worker and the load spread (max / mean requests per worker); and the ideal, an oracle replayed
offline over the same prompts in the order the workers received them in that gateway's cache_aware
run: each goes to the worker with the longest cached prefix among those whose request count stays
within ``--oracle-spread`` x the running mean.  Goal (issue 25): mmgate's cache_aware hit ratio at
least smg's, at a load spread no worse.  The interleaving of conversations depends on timing, so
the numbers move a little from run to run; the trace itself does not.

Run (about 4 minutes on 2 cores):
    python benchmarks/routing.py --out bench-out/routing
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from bench_report import MODELS_DIR, REPO_ROOT, environment, render_table, sample_jpeg
from gateway_procs import start_smg
from routing_sim import BLOCK_TOKENS, Trace, load_spread, make_trace, oracle

from mmgate.cli.launch import Child, free_port, start_gateway

BENCH_OUT = REPO_ROOT / "bench-out"
DEFAULT_MODEL = "Qwen--Qwen3-VL-2B-Instruct"  # smg 1.13 refuses the Qwen2-VL / Qwen2.5-VL bundles (docs/performance.md)
POLICIES = ("random", "round_robin", "least_load", "power_of_two", "consistent_hashing", "prefix_hash", "cache_aware")
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


# ---------------------------------------------------------------- media


def sample_clip(width: int, height: int, seed: int, frames: int = 8, fps: int = 4) -> bytes:
    """A short deterministic H.264 MP4 (a scrolling texture): ``frames`` frames at ``fps``."""
    import av

    rng = np.random.default_rng(seed)
    texture = rng.integers(0, 256, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    texture = np.repeat(np.repeat(texture, 8, axis=0), 8, axis=1)[:height, :width]
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"preset": "ultrafast", "crf": "28"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps)
        for i in range(frames):
            frame = np.ascontiguousarray(np.roll(texture, (i * 3, i * 5), axis=(0, 1)))
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def media_parts(trace: Trace) -> dict[str, dict[str, Any]]:
    """Each media item of the trace as a chat content part with a ``data:`` URL."""
    parts: dict[str, dict[str, Any]] = {}
    for m in trace.media():
        if m.kind == "video":
            url = "data:video/mp4;base64," + base64.b64encode(sample_clip(m.width, m.height, m.seed)).decode()
            parts[m.name] = {"type": "video_url", "video_url": {"url": url}}
        else:
            url = "data:image/jpeg;base64," + base64.b64encode(sample_jpeg(m.width, m.height, m.seed)).decode()
            parts[m.name] = {"type": "image_url", "image_url": {"url": url}}
    return parts


# ---------------------------------------------------------------- processes


class Workers:
    """The recording workers' process and its stdin/stdout control line."""

    def __init__(self, bundle: Path, n: int, args: argparse.Namespace, log_dir: Path) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.log_path = log_dir / "recording-workers.log"
        argv = [sys.executable, str(Path(__file__).with_name("recording_worker.py")), "--model", str(bundle),
                "--ports", *map(str, self.ports), "--capacity-blocks", str(args.capacity_blocks),
                "--block-tokens", str(BLOCK_TOKENS), "--service-ms", str(args.service_ms),
                "--prefill-tok-s", str(args.prefill_tok_s)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log_path, "wb"),  # noqa: SIM115 - owned by the child
                                     start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        from mmgate.cli.launch import wait_grpc_health
        try:
            for port in self.ports:
                wait_grpc_health(Child("recording-worker", self.proc, port, self.log_path), timeout_s=60)
        except BaseException:
            self.stop()
            raise

    def control(self, command: str) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"recording workers exited:\n{self.log_path.read_text()[-3000:]}")
        return json.loads(line)

    def stop(self) -> None:
        Child("recording-worker", self.proc, 0, self.log_path).stop()


def mmgate_policies() -> list[str] | None:
    """The ``--policy`` choices of this mmgate (``mmgate serve --help``), or None when it has no such flag."""
    out = subprocess.run([sys.executable, "-m", "mmgate.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120).stdout
    if "--policy" not in out.replace("--prefill-policy", "").replace("--decode-policy", "").replace(
            "--encode-policy", ""):
        return None
    return [p for p in POLICIES if p in out]


# ---------------------------------------------------------------- client


async def replay(base: str, served: str, trace: Trace, parts: dict[str, dict[str, Any]], concurrency: int,
                 max_tokens: int) -> dict[str, Any]:
    """Send every turn of every conversation; ``concurrency`` conversations at once, turns in order."""
    queue = list(reversed(trace.conversations))
    usage_prompt = errors = done = 0
    error_samples: list[str] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=120.0) as client:
        async def slot() -> None:
            nonlocal usage_prompt, errors, done
            while queue:
                conv = queue.pop()
                media = [parts[m.name] for m in conv.media]
                for turn in range(len(conv.questions)):
                    body = {"model": served, "max_tokens": max_tokens, "temperature": 0, "user": conv.user,
                            "messages": conv.messages(turn, media)}
                    r = await client.post("/v1/chat/completions", json=body, headers={ROUTING_KEY_HEADER: conv.user})
                    done += 1
                    if r.status_code != 200:
                        errors += 1
                        if len(error_samples) < 3:
                            error_samples.append(f"{r.status_code} {r.text[:300]}")
                        continue
                    usage_prompt += int(r.json().get("usage", {}).get("prompt_tokens") or 0)

        await asyncio.gather(*(slot() for _ in range(concurrency)))
    return {"sent": done, "errors": errors, "usage_prompt_tokens": usage_prompt, "error_samples": error_samples}


# ---------------------------------------------------------------- benchmark


def wait_serving(base: str, served: str, timeout_s: float = 60.0) -> None:
    """Until a one-line text request answers 200 (smg lists the model before its tokenizer is registered)."""
    body = {"model": served, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]}
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10.0)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)
    raise RuntimeError(f"{base} did not serve a text request in {timeout_s}s: {last}")


def run_one(gateway: str, policy: str, args: argparse.Namespace, workers: Workers, bundle: Path, served: str,
            trace: Trace, parts: dict[str, dict[str, Any]], log_dir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    if gateway == "mmgate":
        extra = (["--policy", policy] if policy != "default" else []) + list(args.mmgate_arg)
        child = start_gateway(str(bundle), workers.ports, extra=extra, log_dir=log_dir)
    else:
        extra = ["--policy", policy, "--mm-processing", "router", *args.smg_arg]
        child = start_smg(Path(args.smg), bundle, workers.ports, extra, log_dir, None, served)
    startup = time.monotonic() - t0
    try:
        wait_serving(f"http://127.0.0.1:{child.port}", served)
        workers.control("reset")  # after the probe: every run starts from empty caches and zero counts
        t1 = time.monotonic()
        sent = asyncio.run(replay(f"http://127.0.0.1:{child.port}", served, trace, parts, args.concurrency,
                                  args.max_tokens))
        seconds = time.monotonic() - t1
    finally:
        child.stop()
    stats = workers.control("stats")
    log = workers.control("log")
    per_worker = [s["requests"] for s in stats]
    prompt = sum(s["prompt_tokens"] for s in stats)
    cached = sum(s["cached_tokens"] for s in stats)
    row = {"gateway": gateway, "policy": policy, "requests": sum(per_worker), **sent,
           "worker_prompt_tokens": prompt, "cached_tokens": cached, "hit_ratio": cached / prompt if prompt else 0.0,
           "requests_per_worker": per_worker, "spread": load_spread(per_worker),
           "mm_hashes_sent": sum(s["mm_hashes_sent"] for s in stats),
           "mm_items": sum(s["mm_items"] for s in stats),
           "mm_items_keyed_by_rows": sum(s["mm_items_keyed_by_rows"] for s in stats),
           "hash_mismatches": sum(s["hash_mismatches"] for s in stats),
           "startup_s": round(startup, 2), "seconds": round(seconds, 2)}
    print(f"{gateway:6s} {policy:18s} hit {row['hit_ratio']:.3f} spread {row['spread']:.2f} "
          f"per worker {per_worker} errors {row['errors']} prompt tokens {prompt} ({seconds:.1f}s)",
          file=sys.stderr, flush=True)
    if row["error_samples"]:
        print("  errors: " + " | ".join(row["error_samples"]), file=sys.stderr)
    row["_log"] = log
    (log_dir / f"prompts-{gateway}-{policy}.json").write_text(json.dumps(log, separators=(",", ":")))
    return row


def oracle_row(gateway: str, source: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    prompts = [(int(n), keys) for _, _, n, _, keys in sorted(source["_log"], key=lambda e: e[0])]
    res = oracle(prompts, args.workers, args.capacity_blocks, args.oracle_spread)
    return {"gateway": gateway, "policy": f"oracle (spread <= {args.oracle_spread:g})", "requests": len(prompts),
            "errors": 0, "usage_prompt_tokens": None, "worker_prompt_tokens": res.prompt_tokens,
            "cached_tokens": res.hit_tokens, "hit_ratio": res.hit_ratio, "requests_per_worker": res.requests,
            "spread": res.spread, "replayed_from": f"{gateway} {source['policy']}"}


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["policy", "gateway", "requests", "errors", "prompt tokens (usage)", "prompt tokens (workers)",
               "cached tokens", "hit ratio", "requests per worker", "load spread"]
    body = [[r["policy"], r["gateway"], r["requests"], r["errors"],
             r["usage_prompt_tokens"] if r["usage_prompt_tokens"] is not None else "-", r["worker_prompt_tokens"],
             r["cached_tokens"], r["hit_ratio"], " ".join(map(str, r["requests_per_worker"])) or "-",
             r["spread"] if r["spread"] is not None else "-"]
            for r in rows]
    return render_table(headers, body)


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["gateway"], r["policy"]): r for r in rows}
    m, s = by.get(("mmgate", "cache_aware")), by.get(("smg", "cache_aware"))
    if m is None or s is None:
        return {"goal_checked": False, "reason": "a cache_aware run of mmgate or smg is missing"}
    return {"goal_checked": True, "mmgate_hit_ratio": m["hit_ratio"], "smg_hit_ratio": s["hit_ratio"],
            "mmgate_spread": m["spread"], "smg_spread": s["spread"],
            "hit_ratio_at_least_smg": m["hit_ratio"] >= s["hit_ratio"], "spread_no_worse": m["spread"] <= s["spread"],
            "goal_holds": m["hit_ratio"] >= s["hit_ratio"] and m["spread"] <= s["spread"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="bundle folder name under the models dir, or a path")
    ap.add_argument("--out", default=str(BENCH_OUT / "routing"), help="folder for routing.json, routing.md, logs")
    ap.add_argument("--gateways", nargs="+", default=["mmgate", "smg"], choices=["mmgate", "smg"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--users", type=int, default=48, help="conversations in the trace (one per user)")
    ap.add_argument("--seed", type=int, default=25)
    ap.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--capacity-blocks", type=int, default=192, help="prefix-cache capacity per worker (blocks)")
    ap.add_argument("--service-ms", type=float, default=10.0, help="simulated worker time per request")
    ap.add_argument("--prefill-tok-s", type=float, default=50_000.0, help="simulated prefill rate (uncached tokens)")
    ap.add_argument("--oracle-spread", type=float, default=1.5, help="the oracle's bound on max/mean requests")
    ap.add_argument("--smg", default=str(BENCH_OUT / "smg-venv" / "bin" / "smg"))
    ap.add_argument("--mmgate-arg", action="append", default=[], help="extra flag for mmgate serve (repeatable)")
    ap.add_argument("--smg-arg", action="append", default=[], help="extra flag for smg launch (repeatable)")
    args = ap.parse_args(argv)

    bundle = Path(args.model) if Path(args.model).is_dir() else MODELS_DIR / args.model
    org, sep, name = bundle.name.partition("--")
    served = f"{org}/{name}" if sep else bundle.name
    out = Path(args.out)
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if "smg" in args.gateways and not Path(args.smg).exists():
        raise SystemExit(f"smg not found at {args.smg}: python3 -m venv bench-out/smg-venv && "
                         "bench-out/smg-venv/bin/pip install smg==1.13.0")
    mmgate_has = mmgate_policies() if "mmgate" in args.gateways else []
    env = environment() | {"model": str(bundle), "served_model_name": served, "mmgate_policies": mmgate_has,
                           "smg_version": (subprocess.run([args.smg, "--version"], capture_output=True, text=True)
                                           .stdout.strip() if "smg" in args.gateways else None)}
    trace = make_trace(seed=args.seed, users=args.users)
    parts = media_parts(trace)
    kinds = [m.kind for m in trace.media()]
    print(f"# routing benchmark  {env['date_utc']}  cpus={env['cpus']}  model={served}  trace: "
          f"{len(trace.conversations)} conversations, {trace.requests} requests, {kinds.count('image')} images, "
          f"{kinds.count('video')} clips  workers={args.workers} x {args.capacity_blocks} blocks of {BLOCK_TOKENS}",
          file=sys.stderr, flush=True)
    if mmgate_has is None:
        print("mmgate has no --policy flag: its rows run its default worker choice, labelled 'default'",
              file=sys.stderr)
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    workers = Workers(bundle, args.workers, args, log_dir)
    try:
        for policy in args.policies:
            for gateway in args.gateways:
                if gateway == "mmgate" and mmgate_has is None:
                    if policy != args.policies[-1]:
                        continue
                    rows.append(run_one(gateway, "default", args, workers, bundle, served, trace, parts, log_dir))
                    continue
                if gateway == "mmgate" and policy not in (mmgate_has or []):
                    print(f"mmgate has no policy {policy}", file=sys.stderr)
                    continue
                rows.append(run_one(gateway, policy, args, workers, bundle, served, trace, parts, log_dir))
    finally:
        workers.stop()
    for gateway in args.gateways:
        runs = [r for r in rows if r["gateway"] == gateway]
        clean_runs = [r for r in runs if r["errors"] == 0 and r["_log"]]
        source = next((r for r in clean_runs if r["policy"] == "cache_aware"), clean_runs[0] if clean_runs else None)
        if source is not None:
            rows.append(oracle_row(gateway, source, args))
    clean = next((r for r in rows if r.get("_log") and r["errors"] == 0), None)
    if clean is not None:
        prompts = [(int(n), keys) for _, _, n, _, keys in sorted(clean["_log"], key=lambda e: e[0])]
        top = oracle(prompts, 1, 1 << 62, float("inf"))
        rows.append({"gateway": "-", "policy": "ceiling (one unbounded cache)", "requests": len(prompts), "errors": 0,
                     "usage_prompt_tokens": None, "worker_prompt_tokens": top.prompt_tokens,
                     "cached_tokens": top.hit_tokens, "hit_ratio": top.hit_ratio, "requests_per_worker": [],
                     "spread": None, "replayed_from": f"{clean['gateway']} {clean['policy']}"})
    totals = {g: sorted({r["worker_prompt_tokens"] for r in rows if r["gateway"] == g and r["errors"] == 0})
              for g in args.gateways}
    same_tokens = len({t for v in totals.values() for t in v}) <= 1
    result = verdict(rows)
    md = table(rows)
    print()
    print(md)
    print(f"\nprompt-token totals per gateway (error-free runs): {totals} -> "
          f"{'the same' if same_tokens else 'DIFFERENT: the gateways expand some prompts differently'}")
    if result["goal_checked"]:
        print(f"goal (mmgate cache_aware hit ratio >= smg's at a load spread no worse): "
              f"{'holds' if result['goal_holds'] else 'does NOT hold'}  (hit {result['mmgate_hit_ratio']:.3f} vs "
              f"{result['smg_hit_ratio']:.3f}, spread {result['mmgate_spread']:.2f} vs {result['smg_spread']:.2f})")
    print(f"total {time.monotonic() - t0:.0f}s")
    for r in rows:
        r.pop("_log", None)
    payload = {"benchmark": "routing", "env": env, "args": vars(args),
               "trace": {"conversations": len(trace.conversations), "requests": trace.requests,
                         "media": [m.__dict__ for m in trace.media()]},
               "rows": rows, "prompt_token_totals": totals, "same_prompt_tokens": same_tokens, "goal": result}
    (out / "routing.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / "routing.md").write_text(md + "\n")
    print(f"wrote {out / 'routing.json'} and {out / 'routing.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
