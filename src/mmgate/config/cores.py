"""``--workers auto``: how many gateway processes this machine's cores and memory allow.

Stage: settings (read once, at start-up).  In: the process's CPU affinity, the cgroup's CPU quota
and memory limit, ``/proc/meminfo``; out: a process count for :mod:`mmgate.api.multiproc`.

* Cores: ``len(os.sched_getaffinity(0))`` (the CPUs this process may run on: ``taskset``, a
  container's ``cpuset``), lowered to the cgroup's CPU quota rounded up (cgroup v2 ``cpu.max``
  ``"<quota> <period>"``; v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``): a container limited to
  2.5 CPUs on a 64-core host gets 3, not 64.
* Memory: what is available to start processes in (``MemAvailable``, lowered to the cgroup's
  ``memory.max`` minus ``memory.current``, v1 ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``)
  divided by what one gateway process needs (:func:`process_bytes`: its idle size plus the
  encoder input it may hold in flight), with :data:`MEMORY_SHARE` of it kept free for the rest of
  the machine.
* ``auto`` = ``max(1, min(cores, memory allows))``.  docs/performance.md, "Many cores", has the
  measurements behind the numbers.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

#: the value of ``--workers`` that asks for this module's count
AUTO = "auto"
#: RSS of one idle gateway process (measured: ~160 MB for Qwen3-VL-2B, docs/performance.md "Many cores"),
#: rounded up for tokenizers of larger vocabularies
IDLE_PROCESS_BYTES = 256 << 20
#: encoder input one process is assumed to hold in flight when ``--multimodal-max-inflight-bytes`` is unset:
#: a few 1280x960 images or one 10 s 720p clip's float32 ``pixel_values`` (216 MB) serialized once
DEFAULT_INFLIGHT_BYTES = 512 << 20
#: share of the available memory ``auto`` may plan for; the rest stays free (engines, page cache)
MEMORY_SHARE = 0.5

_CGROUP = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_dirs(root: Path) -> list[Path]:
    """This process's cgroup folders: v2 (``0::/path``) and v1 controllers, the root's as a fallback."""
    out: list[Path] = []
    text = _read(Path("/proc/self/cgroup")) or ""
    for line in text.splitlines():
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        rel = rel.lstrip("/")
        if controllers == "":
            out.append(root / rel)
        else:
            for c in controllers.split(","):
                out.append(root / c / rel)
    out.append(root)
    return out


def cgroup_cpu_limit(root: Path = _CGROUP) -> float | None:
    """CPUs the cgroup quota allows (``quota / period``), None when unlimited or unknown."""
    for d in _cgroup_dirs(root):
        v2 = _read(d / "cpu.max")
        if v2:
            quota, _, period = v2.partition(" ")
            if quota != "max" and period:
                return int(quota) / int(period)
            return None
        q, p = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if q and p:
            return int(q) / int(p) if int(q) > 0 else None
    return None


def available_cores(root: Path = _CGROUP) -> int:
    """Cores this process may use: the affinity mask, lowered to the cgroup CPU quota rounded up; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit(root)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def available_memory_bytes(root: Path = _CGROUP, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Memory available for new processes: ``MemAvailable``, lowered to the cgroup limit's headroom;
    None when neither is known."""
    best: int | None = None
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemAvailable:"):
            best = int(line.split()[1]) * 1024
    for d in _cgroup_dirs(root):
        limit = _read(d / "memory.max") or _read(d / "memory.limit_in_bytes")
        used = _read(d / "memory.current") or _read(d / "memory.usage_in_bytes")
        if limit and used and limit != "max" and int(limit) < (1 << 60):
            room = max(0, int(limit) - int(used))
            best = room if best is None else min(best, room)
            break
    return best


def process_bytes(max_inflight_bytes: int | None) -> int:
    """Memory one gateway process is planned to need: idle size + its in-flight encoder input."""
    return IDLE_PROCESS_BYTES + (max_inflight_bytes if max_inflight_bytes is not None else DEFAULT_INFLIGHT_BYTES)


def auto_workers(max_inflight_bytes: int | None, cores: int | None = None, memory: int | None = None) -> int:
    """``--workers auto``: one process per available core, as many as :data:`MEMORY_SHARE` of the
    available memory holds at :func:`process_bytes` each; at least 1."""
    cores = available_cores() if cores is None else cores
    memory = available_memory_bytes() if memory is None else memory
    if memory is None:
        return max(1, cores)
    return max(1, min(cores, int(memory * MEMORY_SHARE) // process_bytes(max_inflight_bytes)))


def count_or_auto(text: str) -> int | str:
    """``--workers`` / ``MMGATE_WORKERS``: ``auto`` or a process count (argparse ``type``).

    Raises:
        argparse.ArgumentTypeError: neither.
    """
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: a process count or auto") from None
