"""Shared test fixtures: model bundles, loopback media server, in-thread gateway.

Bundles are read from ``$MMGATE_MODEL_PATH`` (os.pathsep-separated), else from
``<checkout>/../shared/models``; they are never copied into the repo.  Under ``CI=true`` (or
``MMGATE_REQUIRE_ALL=1``) the session stops before any test when the preflight
(:mod:`tests.support.preflight`) finds a bundle, native extension, tool or corpus generator
missing: there a skip for a missing piece would be a pass that tested nothing.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


def model_roots() -> list[Path]:
    env = os.environ.get("MMGATE_MODEL_PATH")
    if env:
        return [Path(p) for p in env.split(os.pathsep) if p]
    return [REPO.parent / "shared" / "models"]


def bundle_dir(name: str) -> Path:
    """Folder of bundle ``org--name`` (or ``org/name``) on the model search path."""
    for root in model_roots():
        candidate = root / name.replace("/", "--")
        if (candidate / "config.json").is_file():
            return candidate
    raise FileNotFoundError(f"bundle {name} not found under {model_roots()}")


def pytest_sessionstart(session: pytest.Session) -> None:
    from tests.support import preflight

    if preflight.strict_from_env(os.environ):
        missing = preflight.problems(os.environ)
        if missing:
            pytest.exit("preflight (CI): missing " + "; ".join(missing), returncode=1)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After each test (its fixtures torn down; in the process that ran it): the optional RSS log, then,
    after a module's last test, clear the ``functools.cache``s the module defines, collect and trim, so
    one process running the whole suite (or one pytest-xdist worker running a share of it) does not keep
    every module's references and tokenizers to the end (docs/ci.md)."""
    log_rss(item.nodeid)
    module = getattr(item, "module", None)
    if module is None or (nextitem is not None and getattr(nextitem, "module", None) is module):
        return
    for value in list(vars(module).values()):
        if getattr(value, "__module__", None) == module.__name__ and callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the freed heap back (glibc)
    except (OSError, AttributeError):
        pass


def log_rss(nodeid: str) -> None:
    """``MMGATE_TEST_RSS_LOG=<folder>``: append ``<unix s> <RSS MiB> <peak RSS MiB> <test>`` to
    ``<folder>/<xdist worker, or main>.log`` (how docs/ci.md sized the workers)."""
    folder = os.environ.get("MMGATE_TEST_RSS_LOG")
    if not folder:
        return
    with open("/proc/self/statm") as fh:
        rss_mib = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(folder) / f"{worker}.log", "a") as fh:
        fh.write(f"{time.time():.0f} {rss_mib} {peak_mib} {nodeid}\n")


@pytest.fixture(scope="session")
def model_root() -> Path:
    return model_roots()[0]
