"""CI preflight: what the suite needs to run at all, checked before pytest starts.

Without these the suite would still pass while testing nothing: a missing model bundle skips
the parity tier, an unbuilt C extension skips the native-kernel tests, a missing ``ffmpeg``
makes the corpus generator drop its video files (those cases become xfails) and a missing
``redis-server`` leaves the worker-mode sidecar tests without their sidecar.  Checked:

* every bundle in :data:`REQUIRED_BUNDLES` and in the golden fixtures' ``bundles`` rows has a
  ``config.json`` on the model search path (``$MMGATE_MODEL_PATH``, else ``../shared/models``);
* ``mmgate._native.tvresize`` and ``mmgate._native.patchrows`` import (``pip install -e .``
  builds them; ``setup.py`` marks them optional, so a failed compile does not fail the install);
* ``ffmpeg`` and ``redis-server`` are on ``PATH``;
* the pytest plugins ``scripts/test.sh`` passes flags of (pytest-xdist, pytest-timeout) are installed;
* the corpus generator ``make_cases.py`` is in ``$MMGATE_CASES_DIR`` (else ``../shared/cases``).

``python -m tests.support.preflight`` prints one ``preflight: MISSING <what>: <why>`` line per
missing piece.  Strict (``--strict``, or ``CI=true`` / ``MMGATE_REQUIRE_ALL=1`` in the
environment): exit 1 when anything is missing.  Otherwise the lines are warnings, exit 0, and
the tests' own skips stay as they are on a developer's machine.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO / "tests" / "families" / "golden"

#: bundles the tests name outside the golden fixtures (``tests/test_ci_preflight.py`` checks that
#: every ``"<org>--<name>"`` / ``"<org>/<name>"`` literal under tests/ is here or in a fixture)
REQUIRED_BUNDLES = (
    "Qwen--Qwen2-VL-2B-Instruct",
    "Qwen--Qwen2.5-VL-7B-Instruct",
    "Qwen--Qwen3-VL-2B-Instruct",
    "Qwen--Qwen2.5-Omni-7B",
    "Qwen--Qwen3-Omni-30B-A3B-Instruct",
    "Qwen--Qwen3-ASR-0.6B",
    "google--gemma-3-4b-it",
    "llava-hf--llava-1.5-7b-hf",
    "llava-hf--llava-v1.6-mistral-7b-hf",
    "llava-hf--llava-onevision-qwen2-0.5b-ov-hf",
    "meta-llama--Llama-4-Scout-17B-16E-Instruct",
    "OpenGVLab--InternVL3-1B-hf",
)
NATIVE_MODULES = ("mmgate._native.tvresize", "mmgate._native.patchrows")
TOOLS = {
    "ffmpeg": "the corpus generator encodes its video cases with it (without it they become xfails)",
    "redis-server": "the worker-mode sidecar tests start their own",
}


def strict_from_env(env: Mapping[str, str]) -> bool:
    """CI mode: ``CI=true`` (what CI sets) or ``MMGATE_REQUIRE_ALL=1``."""
    return env.get("CI", "").lower() in ("true", "1") or env.get("MMGATE_REQUIRE_ALL", "") == "1"


def model_roots(env: Mapping[str, str]) -> list[Path]:
    """As ``tests/conftest.py`` ``model_roots``: ``$MMGATE_MODEL_PATH`` (os.pathsep-separated), else ../shared/models."""
    raw = env.get("MMGATE_MODEL_PATH", "")
    return [Path(p) for p in raw.split(os.pathsep) if p] or [REPO.parent / "shared" / "models"]


def cases_dir(env: Mapping[str, str]) -> Path:
    """As ``tests/corpus/cases.py`` ``CASES_DIR``."""
    return Path(env.get("MMGATE_CASES_DIR", REPO.parent / "shared" / "cases"))


def required_bundles() -> list[str]:
    """:data:`REQUIRED_BUNDLES` and every bundle a golden fixture's ``bundles`` rows name, in order."""
    names = list(REQUIRED_BUNDLES)
    for path in sorted(GOLDEN_DIR.glob("*.json")):
        for row in json.loads(path.read_text()).get("bundles", []):
            if row["bundle"] not in names:
                names.append(row["bundle"])
    return names


def missing_bundles(env: Mapping[str, str]) -> list[str]:
    roots = model_roots(env)
    absent = [n for n in required_bundles() if not any((r / n / "config.json").is_file() for r in roots)]
    if not absent:
        return []
    where = os.pathsep.join(str(r) for r in roots)
    return [f"model bundles {', '.join(absent)}: not found on the model search path {where} "
            f"(MMGATE_MODEL_PATH, else ../shared/models beside the checkout)"]


def missing_native() -> list[str]:
    problems = []
    for name in NATIVE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            problems.append(f"native extension {name}: does not import ({exc}); build it with `pip install -e .` "
                            f"(a C compiler is needed; setup.py marks it optional, so a failed compile is silent)")
    return problems


def missing_tools(env: Mapping[str, str]) -> list[str]:
    path = env.get("PATH", "")
    return [f"{tool}: not on PATH ({why}; scripts/setup.sh installs it)"
            for tool, why in TOOLS.items() if shutil.which(tool, path=path) is None]


#: the pytest plugins scripts/test.sh passes flags of (-n/--dist/--max-worker-restart, --timeout)
PLUGINS = {"xdist": "pytest-xdist", "pytest_timeout": "pytest-timeout"}


def missing_plugins() -> list[str]:
    return [f"pytest plugin {dist}: not installed (scripts/test.sh runs pytest with its flags; "
            f"`pip install -e \".[test]\"` installs it)" for module, dist in PLUGINS.items()
            if importlib.util.find_spec(module) is None]


def missing_corpus(env: Mapping[str, str]) -> list[str]:
    script = cases_dir(env) / "make_cases.py"
    if script.is_file():
        return []
    return [f"corpus generator {script}: not found (MMGATE_CASES_DIR, else ../shared/cases beside the checkout)"]


def problems(env: Mapping[str, str]) -> list[str]:
    """One line per missing piece; empty when the suite can run all of itself."""
    return missing_bundles(env) + missing_native() + missing_tools(env) + missing_plugins() + missing_corpus(env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 when anything is missing (default under CI)")
    args = parser.parse_args(argv)
    strict = args.strict or strict_from_env(os.environ)
    found = problems(os.environ)
    for line in found:
        print(f"preflight: MISSING {line}", flush=True)
    if found and strict:
        print(f"preflight: FAILED: {len(found)} missing; in CI the suite must not skip what it cannot run", flush=True)
        return 1
    if found:
        print("preflight: not strict (no CI=true / MMGATE_REQUIRE_ALL=1): the tests that need these will skip")
        return 0
    import mmgate

    print(f"preflight: ok: {len(required_bundles())} bundles, {', '.join(NATIVE_MODULES)} "
          f"(from {Path(mmgate.__file__).parent}), {', '.join(TOOLS)}, {', '.join(PLUGINS.values())}, "
          f"corpus generator", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
