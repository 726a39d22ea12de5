"""House rule: a type checker runs over ``src/`` (mypy, settings in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_mypy_is_clean_over_src() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "src/mmgate"], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
