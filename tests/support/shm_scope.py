"""The shared-memory segments a test may call its own, when other test processes share ``/dev/shm``.

Segments are named ``mmgate-<creator pid>-<hex>`` (:func:`mmgate.transport.shm.create`). A test that
checks "no segment left behind" diffs :func:`own_segments` before and after: the segments of this
process, of its live descendants (the gateways and engines it started) and of dead creators (a
leak's signature). Live processes outside this tree, such as another pytest-xdist worker's stack,
are not this test's: counting their in-flight segments made the check fail under ``pytest -n``.
A creator once seen alive outside the tree stays foreign after it dies (another worker may kill
its own gateway mid-request; its segments are that test's to check).
"""

from __future__ import annotations

import os
import time

from mmgate.cli import launch
from mmgate.transport.shm import PREFIX, SHM_DIR, pid_alive

#: creator pids seen alive outside this process's tree (this process's lifetime)
_FOREIGN: set[int] = set()


def tree_pids(root: int | None = None) -> set[int]:
    """``root`` (default: this process) and every live descendant of it (:func:`mmgate.cli.launch.tree_pids`)."""
    return launch.tree_pids(os.getpid() if root is None else root)


def own_segments(directory: str = SHM_DIR) -> set[str]:
    """Names of the ``mmgate-*`` segments in ``directory`` whose creator is in this process's tree, or is
    dead and was never seen alive outside it."""
    ours = tree_pids()
    found: set[str] = set()
    for name in os.listdir(directory):
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit():
            found.add(name)
            continue
        pid = int(pid_text)
        if pid in ours:
            found.add(name)
        elif pid_alive(pid):
            _FOREIGN.add(pid)
        elif pid not in _FOREIGN:
            found.add(name)
    return found


def leftover_segments(before: set[str], settle_s: float = 5.0, directory: str = SHM_DIR) -> set[str]:
    """:func:`own_segments` not in ``before``, once they are gone or ``settle_s`` seconds have passed.

    The wait lets a gateway unlink what its engine has not consumed yet; a leak is still there at the end.
    """
    deadline = time.monotonic() + settle_s
    while (left := own_segments(directory) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
