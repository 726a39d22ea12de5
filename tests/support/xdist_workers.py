"""How many pytest-xdist workers ``scripts/test.sh`` starts: ``python -m tests.support.xdist_workers``.

The suite is latency-bound (most tests wait on engine and gateway processes starting), so more
workers than cores still gains; memory is what bounds it: each worker keeps its own transformers
references, tokenizers and session-scoped stacks (engines, gateways, redis), about 7 GiB at the end
of a third of the suite (measured with ``/proc/self/statm`` after each test, 2026-12-06), and three
workers on a 24 GiB machine were OOM-killed. So: one worker per :data:`WORKER_BYTES` of available
memory (``MemAvailable`` lowered to the cgroup headroom, :func:`mmgate.config.cores.available_memory_bytes`),
at most one more than the cores (:func:`mmgate.config.cores.available_cores`), at least 1.
``MMGATE_TEST_WORKERS`` (a count, or ``auto``) overrides it; 1 runs the suite serially, without xdist.
"""

from __future__ import annotations

import os
import sys

from mmgate.config import cores

#: memory set aside per worker: its own peak (~7 GiB) plus the engines and gateways its tests start
WORKER_BYTES = 10 << 30


def auto_workers(memory: int | None, cpus: int) -> int:
    """Workers for ``memory`` bytes available (``None``: unknown, one worker) and ``cpus`` cores; at least 1."""
    if memory is None:
        return 1
    return max(1, min(cpus + 1, memory // WORKER_BYTES))


def workers(env: dict[str, str]) -> int:
    """``MMGATE_TEST_WORKERS`` as a count (``auto`` or unset: :func:`auto_workers` of this machine).

    Raises:
        SystemExit: the variable is neither a positive count nor ``auto``.
    """
    text = env.get("MMGATE_TEST_WORKERS", "auto").strip().lower()
    if text in ("", "auto"):
        return auto_workers(cores.available_memory_bytes(), cores.available_cores())
    if not text.isdigit() or int(text) < 1:
        raise SystemExit(f"MMGATE_TEST_WORKERS={text!r}: a count of 1 or more, or auto")
    return int(text)


if __name__ == "__main__":
    print(workers(dict(os.environ)))
    sys.exit(0)
