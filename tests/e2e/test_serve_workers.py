"""``mmgate serve --workers N`` end to end: N gateway processes on one port in front of the reference engine.

* Two processes answer an image request with the same prompt tokens, completion text and completion
  tokens (greedy, EOS ignored, each position's token bytes from ``logprobs``) as one process; both serve
  (their ``X-Mmgate-Process`` header names each child of the parent), and ``/metrics`` from either is the
  sum over both (prometheus_client multiprocess mode).
* Life cycle: ``--workers 1`` starts no other process; a child killed with SIGKILL is started again and its
  shared-memory segments are unlinked; SIGTERM to the parent stops every child and leaves no
  ``/dev/shm/mmgate-<child pid>-*`` segment and no metrics folder; SIGKILL to the parent leaves no child.
* Crash loops (issue 20): a process slot whose child dies more than ``MAX_RESTARTS`` times within
  ``RESTART_WINDOW_S`` (the test kills it by pid, found by its ``--index``) is taken out of rotation, logged
  and counted in ``mmgate_serve_children_quarantined``, while the other child serves on the port and the
  parent stays up; once every slot is out, the parent exits with status 1.
* Refusals: ``--workers 0`` / ``MMGATE_WORKERS=0`` / ``--workers two`` stop start-up; a bad model stops a
  two-process start-up with status 2, and a taken port with status 1, as ``mmgate serve``.
* ``--preprocess-threads 0`` (one thread per core) gives each process its share of the cores.
* ``--workers auto`` starts one process per available core that the memory allows, and they answer.
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from mmgate.api.multiproc import MAX_RESTARTS, METRICS_PREFIX, PROCESS_HEADER
from mmgate.api.serve_child import process_settings
from mmgate.cli.launch import Child, start_gateway, wait_processes
from mmgate.config.cores import auto_workers, available_cores
from mmgate.refengine.config import EngineConfig
from mmgate.refengine.server import RunningEngine, start_engine
from mmgate.config.settings import parse_settings
from tests.conftest import bundle_dir

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


def _png(height: int, width: int, seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


BODY: dict[str, Any] = {
    "model": MODEL, "temperature": 0, "max_tokens": 4, "ignore_eos": True, "logprobs": True,
    "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png(60, 90, 3)}},
                                              {"type": "text", "text": "What is in the picture?"}]}]}


def _children(pid: int) -> set[int]:
    """Live (not zombie) child processes of ``pid``."""
    out: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.update(int(c) for c in f.read().split())
    except OSError:
        return set()
    return {c for c in out if _alive(c)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


def _segments(pids: set[int]) -> set[str]:
    return {p.name for pid in pids for p in Path("/dev/shm").glob(f"mmgate-{pid}-*")}


def _plant_segment(pid: int) -> Path:
    """A segment named as process ``pid`` names its own (as if it had not unlinked it yet)."""
    path = Path("/dev/shm") / f"mmgate-{pid}-{os.urandom(8).hex()}"
    path.write_bytes(b"\0" * 64)
    return path


def _answer(resp: httpx.Response) -> tuple[int, str, list[Any]]:
    assert resp.status_code == 200, resp.text
    data = resp.json()
    choice = data["choices"][0]
    return (data["usage"]["prompt_tokens"], choice["message"]["content"],
            [(t["token"], t["bytes"]) for t in choice["logprobs"]["content"]])


def _post(child: Child, body: dict[str, Any]) -> httpx.Response:
    """A chat request on a new connection (so the kernel picks a process for it)."""
    return httpx.post(f"http://127.0.0.1:{child.port}/v1/chat/completions", json=body, timeout=60.0)


@pytest.fixture(scope="module")
def engine() -> Iterator[RunningEngine]:
    running = start_engine(EngineConfig(model=bundle_dir(MODEL), port=0))
    yield running
    running.stop(grace=0)


def _gateway(engine: RunningEngine, processes: int, *extra: str) -> Child:
    return start_gateway(str(bundle_dir(MODEL)), [engine.port], extra=["--served-model-name", MODEL, *extra],
                         processes=processes)


@pytest.fixture(scope="module")
def one(engine: RunningEngine) -> Iterator[Child]:
    child = _gateway(engine, 1)
    yield child
    child.stop()


@pytest.fixture(scope="module")
def two(engine: RunningEngine) -> Iterator[Child]:
    child = _gateway(engine, 2)
    yield child
    child.stop()


def test_the_default_is_this_process_alone(one: Child) -> None:
    assert _children(one.proc.pid) == set()
    assert PROCESS_HEADER not in httpx.get(f"http://127.0.0.1:{one.port}/health", timeout=5).headers


def test_two_processes_answer_as_one_and_both_serve(one: Child, two: Child) -> None:
    want = _answer(_post(one, BODY))
    children = _children(two.proc.pid)
    assert len(children) == 2
    served: set[int] = set()
    for _ in range(40):
        resp = _post(two, BODY)
        assert _answer(resp) == want
        served.add(int(resp.headers[PROCESS_HEADER]))
        if served == children:
            break
    assert served == children


def test_auto_starts_a_process_per_core_the_memory_allows_and_answers(engine: RunningEngine, one: Child) -> None:
    """``--workers auto`` (:mod:`mmgate.config.cores`): as many processes as the machine's cores (affinity,
    cgroup quota) and memory allow, resolved once by the parent; they answer as one process does."""
    cores = available_cores()
    expected = auto_workers(None)
    auto = _gateway(engine, 1, "--workers", "auto")
    try:
        count = len(_children(auto.proc.pid)) or 1  # auto resolving to 1: this process alone, no child
        if expected == cores:  # memory is no limit here: one process per core
            assert count == cores
        assert 1 <= count <= cores
        if count > 1:
            wait_processes(auto, count, want_workers=1)
        assert _answer(_post(auto, BODY)) == _answer(_post(one, BODY))
    finally:
        auto.stop()


def _requests_total(child: Child) -> float:
    text = httpx.get(f"http://127.0.0.1:{child.port}/metrics", timeout=5).text
    values = re.findall(r"^mmgate_requests_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return sum(float(v) for v in values)


def test_metrics_are_summed_over_the_processes(two: Child) -> None:
    before = _requests_total(two)
    for _ in range(6):
        assert _post(two, BODY).status_code == 200
    assert _requests_total(two) == before + 6
    text = httpx.get(f"http://127.0.0.1:{two.port}/metrics", timeout=5).text
    gauges = set(re.findall(r'^mmgate_worker_healthy\{pid="(\d+)"', text, re.MULTILINE))
    assert gauges == {str(p) for p in _children(two.proc.pid)}


def test_a_child_that_dies_is_started_again_and_its_segments_unlinked(two: Child) -> None:
    victim = min(_children(two.proc.pid))
    planted = _plant_segment(victim)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _children(two.proc.pid)
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.1)
    assert victim not in _children(two.proc.pid)
    assert not planted.exists()
    wait_processes(two, 2, want_workers=1)
    assert _post(two, BODY).status_code == 200


def _slot_of(pid: int) -> int | None:
    """The ``--index`` a gateway child was started with (None: not a gateway child, or gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode().split("\0")
    except OSError:
        return None
    return int(args[args.index("--index") + 1]) if "--index" in args else None


def _slot_pid(parent: int, index: int, old: set[int], timeout_s: float = 30.0) -> int | None:
    """The pid of slot ``index``'s child once it is not one of ``old`` (None when none came in time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in _children(parent) - old:
            if _slot_of(pid) == index:
                return pid
        time.sleep(0.05)
    return None


def _crash_loop(gateway: Child, index: int) -> set[int]:
    """Kill slot ``index``'s child as soon as it is (re)started, MAX_RESTARTS + 1 times: within seconds, far
    inside the restart window.  Returns the killed pids (the last may not have died yet when this returns)."""
    killed: set[int] = set()
    for _ in range(MAX_RESTARTS + 1):
        pid = _slot_pid(gateway.proc.pid, index, killed)
        assert pid is not None, f"slot {index} was not started again:\n{gateway.log_tail()}"
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
    return killed


def _quarantined(child: Child) -> float:
    text = httpx.get(f"http://127.0.0.1:{child.port}/metrics", timeout=5).text
    return float(re.findall(r"^mmgate_serve_children_quarantined (\S+)$", text, re.MULTILINE)[0])


def test_a_crash_looping_child_is_taken_out_of_rotation_and_the_last_one_stops_the_parent(
        engine: RunningEngine, tmp_path: Path) -> None:
    gateway = start_gateway(str(bundle_dir(MODEL)), [engine.port], extra=["--served-model-name", MODEL],
                            processes=2, log_dir=tmp_path)
    try:
        children = _children(gateway.proc.pid)
        survivor = next(pid for pid in children if _slot_of(pid) == 1)
        assert _quarantined(gateway) == 0
        killed = _crash_loop(gateway, 0)
        assert _slot_pid(gateway.proc.pid, 0, killed, timeout_s=3) is None  # not started again
        assert gateway.proc.poll() is None  # the parent serves on
        assert _children(gateway.proc.pid) == {survivor}
        for _ in range(6):  # new connections: the kernel has only the survivor's socket left
            resp = _post(gateway, BODY)
            assert resp.status_code == 200 and int(resp.headers[PROCESS_HEADER]) == survivor
        assert _quarantined(gateway) == 1
        assert "gateway process 0 taken out of rotation: it exited 6 times within 60 s; 1 of 2 processes serve on" \
            in gateway.log_tail(20000)
        _crash_loop(gateway, 1)
        assert gateway.proc.wait(timeout=30) == 1  # no child can serve: the parent exits
        assert "every gateway process is out of rotation: stopping" in gateway.log_tail(20000)
        assert _children(gateway.proc.pid) == set()
    finally:
        gateway.stop()


def test_sigterm_stops_every_process_and_leaves_no_segment(engine: RunningEngine) -> None:
    gateway = _gateway(engine, 2, "--multimodal-tensor-transport", "shm", "--multimodal-shm-min-bytes", "0")
    try:
        children = _children(gateway.proc.pid)
        assert _post(gateway, BODY).status_code == 200
        for pid in children:
            _plant_segment(pid)
        metrics_dirs = list(Path(tempfile.gettempdir()).glob(f"{METRICS_PREFIX}{gateway.proc.pid}-*"))
        assert len(metrics_dirs) == 1
        os.kill(gateway.proc.pid, signal.SIGTERM)  # the parent alone: it stops its children
        assert gateway.proc.wait(timeout=40) == 0
        assert _wait_gone(children, 5) == set()
        assert _segments(children) == set()
        assert not metrics_dirs[0].exists()
    finally:
        gateway.stop()


def test_killing_the_parent_leaves_no_child(engine: RunningEngine) -> None:
    gateway = _gateway(engine, 2)
    try:
        children = _children(gateway.proc.pid)
        assert len(children) == 2
        os.kill(gateway.proc.pid, signal.SIGKILL)
        gateway.proc.wait(timeout=10)
        assert _wait_gone(children, 20) == set()
    finally:
        gateway.stop()
        for pid in _children(gateway.proc.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("argv", "environ", "message"), [
    (["--workers", "0"], {}, "--workers must be at least 1"),
    ([], {"MMGATE_WORKERS": "0"}, "MMGATE_WORKERS must be at least 1"),
    ([], {"MMGATE_WORKERS": "two"}, "unreadable MMGATE_WORKERS='two'"),
    (["--workers", "-1"], {}, "--workers must be at least 1"),
])
def test_a_bad_process_count_is_refused(argv: list[str], environ: dict[str, str], message: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        parse_settings(["--model", MODEL, *argv], environ)


def test_the_command_refuses_a_bad_process_count_a_taken_port_and_a_bad_model() -> None:
    serve = [sys.executable, "-m", "mmgate.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    bad_count = subprocess.run([*serve, "--model", MODEL, "--workers", "two"], capture_output=True, text=True,
                               timeout=60, check=False)
    assert bad_count.returncode == 2 and "--workers: invalid value 'two': a process count or auto" in bad_count.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        busy = subprocess.run([*serve[:-1], port, "--model", MODEL, "--workers", "2"], capture_output=True,
                              text=True, timeout=60, check=False)
    assert busy.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr, busy.stderr
    bad_model = subprocess.run([*serve, "--model", "no-such/model", "--workers", "2"], capture_output=True,
                               text=True, timeout=120, check=False)
    assert bad_model.returncode == 2, bad_model.stderr
    assert "no-such/model" in bad_model.stderr


def test_each_process_gets_its_share_of_the_cores_unless_threads_are_set() -> None:
    def threads(*argv: str) -> int:
        return process_settings(parse_settings(["--model", MODEL, *argv], {}), cpus=16).preprocess_threads

    assert threads("--workers", "2") == 8  # 16 cores / 2 processes
    assert threads("--workers", "3") == 6  # ceil(16 / 3)
    assert threads("--workers", "32") == 1
    assert threads("--workers", "2", "--preprocess-threads", "4") == 4  # as set
