"""CI cannot pass while testing nothing (issue 22): ``.ci/run`` fails, naming what is missing.

Each failing case runs the real ``.ci/run`` in a scratch copy of the checkout (``.ci``,
``scripts``, ``src``, ``tests``) whose ``scripts/setup.sh`` is a stub (no pip, no apt): the
preflight that ``scripts/test.sh`` runs before pytest must stop the run there, so no test runs
and each case takes a second or two.  The cases: no ``../shared`` beside the copy (no model
bundles, no corpus generator), a ``src`` without the built ``mmgate._native`` ``.so`` files,
and a ``PATH`` without ``ffmpeg``.  The control: the preflight passes in this environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, model_roots
from tests.support import preflight

RUN_TIMEOUT_S = 120
#: folders a test writes under an ``<org>--<name>`` name of its own; not bundles of the search path
WRITTEN_BY_TESTS = {"Qwen--Qwen3-VL-2B-Thinking-test"}
_SETUP_STUB = '#!/usr/bin/env bash\necho "setup: stubbed in the scratch copy"\n'


def scratch_checkout(root: Path, native: bool = True) -> Path:
    """A copy of the checkout under ``root/repo`` (nothing beside it), setup stubbed; ``native=False``: no ``.so``."""
    repo = root / "repo"
    skip = ["__pycache__", "*.pyc", ".pytest_cache"] + ([] if native else ["*.so"])
    for name in (".ci", "scripts", "src", "tests"):
        shutil.copytree(REPO / name, repo / name, ignore=shutil.ignore_patterns(*skip))
    (repo / "scripts" / "setup.sh").write_text(_SETUP_STUB)
    return repo


def ci_env(repo: Path, **overrides: str) -> dict[str, str]:
    """The environment of a CI run of the copy: its own ``src`` first on the import path, this interpreter."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MMGATE_MODEL_PATH", "MMGATE_CASES_DIR", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")}
    env.update(CI="true", PYTHONPATH=str(repo / "src"), PYTHON=sys.executable)
    env.update(overrides)
    return env


def shared_paths() -> dict[str, str]:
    """The real model search path and corpus folder, for the cases where they are not what is missing."""
    return {"MMGATE_MODEL_PATH": os.pathsep.join(str(r) for r in model_roots()),
            "MMGATE_CASES_DIR": str(preflight.cases_dir(os.environ))}


def run_ci(repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(repo / ".ci" / "run")], cwd=repo, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)


def assert_stopped_by_preflight(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode != 0, result.stdout
    assert "== ci: FAILED at step 'tests'" in result.stdout, result.stdout
    assert "preflight: FAILED" in result.stdout, result.stdout
    assert not re.search(r"\d+ (passed|skipped|xfailed)", result.stdout), "pytest ran: " + result.stdout


def test_preflight_passes_in_this_environment() -> None:
    missing = preflight.problems(os.environ)
    if missing and not preflight.strict_from_env(os.environ):
        pytest.skip("not CI, and this machine lacks: " + "; ".join(missing))
    result = subprocess.run([sys.executable, "-m", "tests.support.preflight", "--strict"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout
    assert result.stdout.startswith("preflight: ok:"), result.stdout


def test_ci_run_fails_naming_the_bundles_when_shared_models_is_missing(tmp_path: Path) -> None:
    repo = scratch_checkout(tmp_path)
    result = run_ci(repo, ci_env(repo))
    assert_stopped_by_preflight(result)
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("preflight: MISSING model bundles")]
    assert "Qwen--Qwen2-VL-2B-Instruct" in line and "google--gemma-3-4b-it" in line
    assert str(tmp_path / "shared" / "models") in line  # the ../shared/models .ci/run looked in


def test_ci_run_fails_naming_each_unbuilt_native_extension(tmp_path: Path) -> None:
    repo = scratch_checkout(tmp_path, native=False)
    assert not list((repo / "src" / "mmgate" / "_native").glob("*.so"))
    result = run_ci(repo, ci_env(repo, **shared_paths()))
    assert_stopped_by_preflight(result)
    missing = [ln for ln in result.stdout.splitlines() if ln.startswith("preflight: MISSING")]
    assert [ln.split(":")[1].strip() for ln in missing] == [
        "MISSING native extension mmgate._native.tvresize", "MISSING native extension mmgate._native.patchrows"]


def test_ci_run_fails_naming_ffmpeg_when_it_is_not_on_path(tmp_path: Path) -> None:
    repo = scratch_checkout(tmp_path)
    bin_dir = tmp_path / "bin"  # what .ci/run and scripts/test.sh call, and redis-server: everything but ffmpeg
    bin_dir.mkdir()
    for tool in ("bash", "env", "dirname", "redis-server"):
        found = shutil.which(tool)
        assert found is not None, f"{tool} is needed to run this test"
        (bin_dir / tool).symlink_to(found)
    (bin_dir / "python3").symlink_to(Path(sys.executable).resolve())
    result = run_ci(repo, ci_env(repo, PATH=str(bin_dir), **shared_paths()))
    assert_stopped_by_preflight(result)
    missing = [ln for ln in result.stdout.splitlines() if ln.startswith("preflight: MISSING")]
    assert len(missing) == 1 and missing[0].startswith("preflight: MISSING ffmpeg: not on PATH"), result.stdout


def test_a_missing_pytest_plugin_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert preflight.missing_plugins() == []  # pytest-xdist and pytest-timeout: here, as setup installs them
    monkeypatch.setattr(preflight, "PLUGINS", {**preflight.PLUGINS, "mmgate_no_such_plugin": "pytest-no-such"})
    lines = preflight.missing_plugins()
    assert len(lines) == 1 and lines[0].startswith("pytest plugin pytest-no-such: not installed"), lines
    assert any(line.startswith("pytest plugin pytest-no-such") for line in preflight.problems(os.environ))


def test_every_bundle_the_tests_name_is_one_the_preflight_checks() -> None:
    orgs = {name.split("--")[0] for name in preflight.required_bundles()}
    literal = re.compile(r"""["']((?:%s)(?:--|/)[A-Za-z0-9._-]+)["']""" % "|".join(map(re.escape, sorted(orgs))))
    named = {m.group(1).replace("/", "--") for path in (REPO / "tests").rglob("*.py")
             for m in literal.finditer(path.read_text())}
    assert named - WRITTEN_BY_TESTS <= set(preflight.required_bundles()), named - set(preflight.required_bundles())
