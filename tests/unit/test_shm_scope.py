"""tests/support/shm_scope.py: which ``mmgate-<pid>-*`` segments a leak check counts as its own.

The segments are planted in a private folder on the same tmpfs (another pytest-xdist worker's gateway
sweeps dead creators' segments from ``/dev/shm`` itself when it starts).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmgate.transport.shm import PREFIX, SHM_DIR
from tests.support.shm_scope import leftover_segments, own_segments, tree_pids


@pytest.fixture
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir=SHM_DIR, prefix="scope-test-") as name:
        yield Path(name)


def plant(folder: Path, pid: int) -> str:
    name = f"{PREFIX}{pid}-{secrets.token_hex(8)}"
    (folder / name).write_bytes(b"\0" * 8)
    return name


def test_this_process_its_children_and_dead_creators_count_a_live_stranger_does_not(folder: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        assert {os.getpid(), child.pid} <= tree_pids() and 1 not in tree_pids()
        mine, childs, deads = plant(folder, os.getpid()), plant(folder, child.pid), plant(folder, dead.pid)
        stranger = plant(folder, 1)  # pid 1 is alive and not below this process
        assert own_segments(str(folder)) == {mine, childs, deads}
        assert stranger not in own_segments(str(folder))
    finally:
        child.kill()
        child.wait()


def test_a_stranger_seen_alive_stays_a_stranger_after_it_dies(folder: Path) -> None:
    # not a descendant: started by a shell that exits at once, so the process is adopted elsewhere
    line = f"{sys.executable} -c 'import time; time.sleep(30)' >/dev/null 2>&1 & echo $!"
    started = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True)
    pid = int(started.stdout.strip())
    assert pid not in tree_pids()
    name = plant(folder, pid)
    assert own_segments(str(folder)) == set()  # alive outside the tree: remembered, not counted
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), "the stranger was not reaped"
    assert name not in own_segments(str(folder))  # dead now, but it was foreign


def test_leftover_waits_for_a_segment_to_go_and_reports_one_that_stays(folder: Path) -> None:
    before = own_segments(str(folder))
    name = plant(folder, os.getpid())
    assert leftover_segments(before, settle_s=0.2, directory=str(folder)) == {name}
    (folder / name).unlink()
    assert leftover_segments(before, settle_s=0.2, directory=str(folder)) == set()
