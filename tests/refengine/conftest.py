"""Fixtures for the reference-engine tests: offline hub, bundles, in-process engines.

Engines are started once per session per bundle (``start_engine`` with port 0
on 127.0.0.1) and stopped at the end.  A missing bundle skips its tests.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported anywhere

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from mmgate.refengine.config import EngineConfig  # noqa: E402
from mmgate.refengine.server import RunningEngine, start_engine  # noqa: E402
from tests.refengine.refengine_support import QWEN2_VL, require_bundle  # noqa: E402


@pytest.fixture(scope="session")
def engine_for() -> Iterator[Callable[[Path], RunningEngine]]:
    """``engine_for(bundle_path)``: a running in-process engine for that bundle (one per session)."""
    engines: dict[Path, RunningEngine] = {}

    def get(path: Path) -> RunningEngine:
        if path not in engines:
            engines[path] = start_engine(EngineConfig(model=path, port=0, max_tokens_default=16))
        return engines[path]

    yield get
    for engine in engines.values():
        engine.stop(grace=0)


@pytest.fixture(scope="session")
def qwen2_vl_bundle() -> Path:
    return require_bundle(QWEN2_VL)


@pytest.fixture(scope="session")
def qwen2_vl_engine(engine_for: Callable[[Path], RunningEngine], qwen2_vl_bundle: Path) -> RunningEngine:
    return engine_for(qwen2_vl_bundle)
