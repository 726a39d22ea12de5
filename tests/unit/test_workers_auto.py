"""``--workers auto`` (:mod:`mmgate.config.cores`): cores from the affinity mask and the cgroup CPU quota,
memory from ``MemAvailable`` and the cgroup limit, the count from both; the flag and the variable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mmgate.config import cores
from mmgate.config.settings import parse_settings

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
GIB = 1 << 30


def _cgroup(tmp_path: Path, **files: str) -> Path:
    for name, text in files.items():
        (tmp_path / name.replace("__", ".")).write_text(text + "\n")
    return tmp_path


def test_cores_are_the_affinity_mask_lowered_to_the_cgroup_quota_rounded_up(tmp_path: Path) -> None:
    mask = len(os.sched_getaffinity(0))
    empty = tmp_path / "none"
    empty.mkdir()
    assert cores.available_cores(empty) == mask  # no quota file: the mask
    v2 = tmp_path / "v2"
    v2.mkdir()
    assert cores.cgroup_cpu_limit(_cgroup(v2, cpu__max="150000 100000")) == 1.5
    assert cores.available_cores(v2) == min(mask, 2)  # 1.5 CPUs: 2 processes
    unlimited = tmp_path / "v2max"
    unlimited.mkdir()
    assert cores.cgroup_cpu_limit(_cgroup(unlimited, cpu__max="max 100000")) is None
    v1 = tmp_path / "v1"
    v1.mkdir()
    assert cores.cgroup_cpu_limit(_cgroup(v1, cpu__cfs_quota_us="50000", cpu__cfs_period_us="100000")) == 0.5
    assert cores.available_cores(v1) == 1
    v1_off = tmp_path / "v1off"
    v1_off.mkdir()
    assert cores.cgroup_cpu_limit(_cgroup(v1_off, cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")) is None


def test_memory_is_memavailable_lowered_to_the_cgroup_headroom(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8388608 kB\n")
    root = tmp_path / "cg"
    root.mkdir()
    assert cores.available_memory_bytes(root, meminfo) == 8 * GIB
    _cgroup(root, memory__max=str(3 * GIB), memory__current=str(1 * GIB))
    assert cores.available_memory_bytes(root, meminfo) == 2 * GIB
    (root / "memory.max").write_text("max\n")
    assert cores.available_memory_bytes(root, meminfo) == 8 * GIB


def test_auto_is_one_process_per_core_that_half_the_memory_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    per = cores.process_bytes(None)
    assert per == cores.IDLE_PROCESS_BYTES + cores.DEFAULT_INFLIGHT_BYTES
    assert cores.auto_workers(None, cores=16, memory=128 * GIB) == 16  # memory is no limit
    assert cores.auto_workers(None, cores=16, memory=4 * GIB) == (2 * GIB) // per  # memory is: 2 processes
    assert cores.auto_workers(None, cores=16, memory=100 << 20) == 1  # never below 1
    small_budget = cores.IDLE_PROCESS_BYTES + (64 << 20)
    assert cores.auto_workers(64 << 20, cores=16, memory=4 * GIB) == (2 * GIB) // small_budget
    # memory=None reads available_memory_bytes (patched: the machine's changes while other tests run)
    monkeypatch.setattr(cores, "available_memory_bytes", lambda: 4 * GIB)
    assert cores.auto_workers(None, cores=16) == (2 * GIB) // per
    monkeypatch.setattr(cores, "available_memory_bytes", lambda: None)
    assert cores.auto_workers(None, cores=3, memory=None) == 3  # memory unknown: the cores alone


def test_the_flag_and_the_variable_take_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    assert 1 <= cores.auto_workers(None) <= cores.available_cores()  # this machine, as it is now
    monkeypatch.setattr(cores, "available_cores", lambda: 6)
    monkeypatch.setattr(cores, "available_memory_bytes", lambda: 64 * GIB)
    expected = 6
    assert parse_settings(["--model", MODEL, "--workers", "auto"], {}).processes == expected
    assert parse_settings(["--model", MODEL], {"MMGATE_WORKERS": "AUTO"}).processes == expected
    assert parse_settings(["--model", MODEL, "--workers", "auto", "--multimodal-max-inflight-bytes", str(GIB)],
                          {}).processes == cores.auto_workers(GIB)
    assert parse_settings(["--model", MODEL, "--workers", "3"], {}).processes == 3
    assert parse_settings(["--model", MODEL], {}).processes == 1  # the default: this process alone
    with pytest.raises(SystemExit, match="unreadable MMGATE_WORKERS='many'"):
        parse_settings(["--model", MODEL], {"MMGATE_WORKERS": "many"})
