"""tests/support/shm_scope.py: which ``/dev/shm/mmgate-<pid>-*`` segments a leak check counts as its own."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mmgate.transport.shm import PREFIX, SHM_DIR
from tests.support.shm_scope import leftover_segments, own_segments, tree_pids


@contextmanager
def planted(pid: int) -> Iterator[str]:
    name = f"{PREFIX}{pid}-{secrets.token_hex(8)}"
    path = Path(SHM_DIR) / name
    path.write_bytes(b"\0" * 8)
    try:
        yield name
    finally:
        path.unlink(missing_ok=True)


def test_this_process_its_children_and_dead_creators_count_a_live_stranger_does_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        assert {os.getpid(), child.pid} <= tree_pids() and 1 not in tree_pids()
        with planted(os.getpid()) as mine, planted(child.pid) as childs, planted(dead.pid) as deads, \
                planted(1) as strangers:  # pid 1 is alive and not below this process
            found = own_segments()
            assert {mine, childs, deads} <= found
            assert strangers not in found
    finally:
        child.kill()
        child.wait()


def test_leftover_waits_for_a_segment_to_go_and_reports_one_that_stays() -> None:
    before = own_segments()
    with planted(os.getpid()) as name:
        assert leftover_segments(before, settle_s=0.2) == {name}
    assert leftover_segments(before, settle_s=0.2) == set()
