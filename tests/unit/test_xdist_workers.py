"""``scripts/test.sh``'s worker count (tests/support/xdist_workers.py): memory first, then cores."""

from __future__ import annotations

import pytest

from tests.support.xdist_workers import WORKER_BYTES, auto_workers, workers

GIB = 1 << 30


def test_one_worker_per_ten_gib_available_at_most_one_more_than_the_cores() -> None:
    assert WORKER_BYTES == 10 * GIB
    assert auto_workers(23 * GIB, 2) == 2  # this machine kind, quiet: 2 cores, 24 GiB, 23 GiB available
    assert auto_workers(29 * GIB, 2) == 2  # three were OOM-killed on 24 GiB; three need 30 GiB available
    assert auto_workers(19 * GIB, 2) == 1  # two took up to 17.5 GiB: they need 20 GiB available
    assert auto_workers(128 * GIB, 16) == 12  # memory bounds a 16-core machine
    assert auto_workers(512 * GIB, 4) == 5  # cores + 1: the suite waits on child processes
    assert auto_workers(3 * GIB, 8) == 1  # never below 1
    assert auto_workers(None, 8) == 1  # memory unknown: serial


def test_the_variable_overrides_and_a_bad_value_stops_the_run() -> None:
    assert workers({"MMGATE_TEST_WORKERS": "3"}) == 3
    assert workers({"MMGATE_TEST_WORKERS": "1"}) == 1
    assert workers({"MMGATE_TEST_WORKERS": "AUTO"}) >= 1 and workers({}) >= 1  # this machine, as it is now
    for bad in ("0", "-2", "many", "\u00b2"):
        with pytest.raises(SystemExit, match="MMGATE_TEST_WORKERS"):
            workers({"MMGATE_TEST_WORKERS": bad})
