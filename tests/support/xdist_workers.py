"""How many pytest-xdist workers ``scripts/test.sh`` starts: ``python -m tests.support.xdist_workers``.

The suite is latency-bound (most tests wait on engine and gateway processes starting), so more
workers than cores still gains; memory is what bounds it: each worker keeps its own transformers
references, tokenizers and session-scoped stacks (engines, gateways, redis): with two workers on a 24 GiB
machine their RSS peaked at 6.4 and 8.6 GiB and MemAvailable never fell under 5.5 GiB; with three, a worker
was OOM-killed (``MMGATE_TEST_RSS_LOG``, tests/conftest.py; 2026-12-06). So: one worker per
:data:`WORKER_BYTES` of available memory (``MemAvailable`` lowered to the cgroup headroom,
:func:`mmgate.config.cores.available_memory_bytes`),
at most one more than the cores (:func:`mmgate.config.cores.available_cores`), at least 1.
``MMGATE_TEST_WORKERS`` (a count, or ``auto``) overrides it; 1 runs the suite serially, without xdist.
"""

from __future__ import annotations

import os
import sys

from mmgate.config import cores

#: memory set aside per worker: two workers took up to 17.5 GiB of MemAvailable in all (23.0 GiB quiet, 5.5 GiB
#: at the lowest; their own RSS peaks 6.4 and 8.6 GiB plus the engines and gateways their tests start)
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
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise SystemExit(f"MMGATE_TEST_WORKERS={text!r}: a count of 1 or more, or auto")
    return int(text)


if __name__ == "__main__":
    print(workers(dict(os.environ)))
    sys.exit(0)
