"""Processes of the end-to-end benchmark: start the null worker and smg, measure process-tree memory.

mmgate itself is started with ``mmgate.cli.launch.start_gateway`` (the same way the
tests and the quick start do); every child runs in its own session and is
stopped by its own process group (``Child.stop``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench_report import REPO_ROOT

from mmgate.cli.launch import Child, free_port, tree_pids, wait_grpc_health


def _spawn(name: str, argv: Sequence[str], port: int, log_dir: Path, env: dict[str, str] | None = None) -> Child:
    log_path = log_dir / f"{name}-{port}.log"
    out = open(log_path, "wb")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env or dict(os.environ, PYTHONUNBUFFERED="1"), cwd=REPO_ROOT)
    return Child(name=name, proc=proc, port=port, log_path=log_path)


def start_null_worker(bundle: Path, log_dir: Path) -> Child:
    port = free_port()
    child = _spawn("null-worker", [sys.executable, str(Path(__file__).with_name("null_worker.py")),
                                   "--model", str(bundle), "--port", str(port)], port, log_dir)
    try:
        wait_grpc_health(child, timeout_s=60)
    except BaseException:
        child.stop()
        raise
    return child


def mmgate_has_transport_flags() -> bool:
    out = subprocess.run([sys.executable, "-m", "mmgate.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    return "--multimodal-tensor-transport" in out.stdout


def start_smg(smg_bin: Path, bundle: Path, worker_port: int | Sequence[int], transport_args: Sequence[str],
              log_dir: Path, turbojpeg_dir: Path | None, served_name: str, timeout_s: float = 90.0) -> Child:
    """``smg launch`` in front of the worker(s) on ``worker_port``; returns once every worker is ready and the
    model is listed (``transport_args``: any further flags)."""
    ports = [worker_port] if isinstance(worker_port, int) else list(worker_port)
    port, prom_port = free_port(), free_port()
    env = dict(os.environ)
    if turbojpeg_dir is not None and (turbojpeg_dir / "libturbojpeg.so.0").exists():
        env["LD_LIBRARY_PATH"] = f"{turbojpeg_dir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    argv = [str(smg_bin), "launch", "--worker-urls", *[f"grpc://127.0.0.1:{p}" for p in ports],
            "--model-path", str(bundle), "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(prom_port), "--log-level", "warn", *transport_args]
    child = _spawn("smg", argv, port, log_dir, env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise RuntimeError(f"smg exited ({child.proc.returncode}):\n{child.log_tail()}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=1.0)
            workers = r.json().get("workers", []) if r.status_code == 200 else []
            if sum(1 for w in workers if w.get("is_healthy") and w.get("status") == "ready") >= len(ports):
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1.0).json().get("data", [])
                if any(m.get("id") == served_name for m in models):
                    return child
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    child.stop()
    raise RuntimeError(f"smg did not become ready in {timeout_s}s:\n{child.log_tail()}")


def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_kb(pid: int, key: str) -> int:
    """Sum of ``key`` (VmRSS, VmHWM) in kB over ``pid`` and its descendants."""
    return sum(_status_kb(p, key) for p in tree_pids(pid))


_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> tuple[float, int]:
    """(CPU seconds user+system, minor page faults) over ``pid`` and its descendants (``/proc/<pid>/stat``)."""
    cpu, faults = 0.0, 0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        # after "(comm)": state=0 ... minflt=7, utime=11, stime=12 (proc(5) fields 10, 14, 15)
        faults += int(fields[7])
        cpu += (int(fields[11]) + int(fields[12])) / _TICK
    return cpu, faults


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (``/proc/stat`` first line)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])
    return (total - idle) / _TICK, total / _TICK


class RssSampler:
    """Samples the VmRSS of each gateway's process tree every ``interval_s`` in a thread."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.02) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), {n: tree_kb(p, "VmRSS") for n, p in self.pids.items()}))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def peak_kb(self, name: str, windows: Sequence[tuple[float, float]]) -> int:
        return max((s[name] for t, s in self.samples if any(a <= t <= b for a, b in windows)), default=0)
