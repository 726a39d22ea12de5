"""The edge-case corpus of ``../shared/cases``: generated into a temporary folder, classified, materialized.

``load_corpus()`` runs ``make_cases.py OUT`` once per test session (at
collection, so each case becomes one parametrized test) into a temporary
folder removed at exit; nothing is written into the shared folder or the
repository.  ``pending_reason(case)`` names why a case cannot be judged yet
(a profile the runner does not serve, video for a family that takes none, a
unit-calculation case, a file the generator skipped); such cases are
collected and reported, never dropped.  In CI (``CI=true`` /
``MMGATE_REQUIRE_ALL=1``) a skipped file is not pending but missing:
:func:`missing_files_reason` fails its case.  Served profiles: the Qwen-VL ones
(``qwen2_vl``, ``qwen3_vl``) and ``llava_1_5`` (the LLaVA-1.5 bundle, CLIP
shortest-edge resize and centre crop).
"""

from __future__ import annotations

import atexit
import base64
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import REPO
from tests.support.preflight import strict_from_env

CASES_DIR = Path(os.environ.get("MMGATE_CASES_DIR", REPO.parent / "shared" / "cases"))
SUPPORTED_PROFILES = ("qwen2_vl", "qwen3_vl", "llava_1_5")
#: the profile every corpus stack starts, cases or not: the SSRF gateway, the soak and the intake tests use it
BASE_PROFILE = "qwen2_vl"
MIME = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif",
        ".webp": "image/webp", ".mp4": "video/mp4"}


@dataclass(frozen=True)
class Corpus:
    root: Path  # OUT_DIR: files/ and cases.json
    doc: dict[str, Any]

    @property
    def cases(self) -> list[dict[str, Any]]:
        return list(self.doc["cases"])

    @property
    def profiles(self) -> dict[str, dict[str, Any]]:
        return dict(self.doc["profiles"])

    def file(self, name: str) -> bytes:
        return (self.root / "files" / name).read_bytes()


@functools.lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    """Generate the corpus into a fresh temporary folder (removed when the process exits)."""
    out = Path(tempfile.mkdtemp(prefix="mmgate-corpus-"))
    atexit.register(shutil.rmtree, out, True)
    subprocess.run([sys.executable, str(CASES_DIR / "make_cases.py"), str(out)], check=True,
                   stdout=subprocess.DEVNULL, timeout=300)
    return Corpus(root=out, doc=json.loads((out / "cases.json").read_text()))


def profiles_in_use(corpus: Corpus) -> tuple[str, ...]:
    """The supported profiles the corpus's cases name, and :data:`BASE_PROFILE`: the stacks to start."""
    named = {c.get("model_profile", "") for c in corpus.cases}
    return tuple(p for p in SUPPORTED_PROFILES if p in named or p == BASE_PROFILE)


def group_of(case_id: str) -> str:
    """``BH-01-w28h26`` -> ``BH-01``."""
    return "-".join(case_id.split("-")[:2])


def needs_video(case: dict[str, Any]) -> bool:
    parts = [p for m in case.get("request", {}).get("messages", []) for p in (m.get("content") or [])
             if isinstance(p, dict)]
    return any(p.get("type") == "video_url" for p in parts) or str(case.get("request", {}).get("calc", "")).endswith(
        "frames")


@functools.cache
def family_accepts_video(profile: str) -> bool:
    """Whether the profile's family, built from its bundle as the gateway builds it, takes video."""
    from mmgate.chat.tokenizer import load_tokenizer
    from mmgate.models.bundle import resolve_bundle
    from mmgate.models.geometry import resolve_backend
    from mmgate.models.registry import load_family
    from mmgate.models.backend import ImageBackend
    from mmgate.types import Modality
    from tests.conftest import bundle_dir
    from tests.corpus.stack import PROFILE_BASE

    bundle = resolve_bundle(str(bundle_dir(PROFILE_BASE[profile].replace("--", "/"))), ())
    family = load_family(bundle, load_tokenizer(bundle), resolve_backend(ImageBackend.AUTO))
    return family is not None and Modality.VIDEO in family.limits


def video_patchify_available() -> bool:
    try:
        from mmgate.models.video_pixels import patchify_video  # noqa: F401
    except ImportError:
        return False
    return True


def pending_reason(case: dict[str, Any]) -> str | None:
    """Why ``case`` cannot be judged by this gateway yet, or None."""
    profile = case.get("model_profile", "")
    if profile not in SUPPORTED_PROFILES:
        return f"model family of profile {profile!r} is not supported by mmgate yet"
    if case.get("transport") == "unit" and not video_patchify_available():
        return "unit calculation case (no request): needs mmgate's video patchify to check against"
    if needs_video(case) and not family_accepts_video(profile):
        return f"needs video input: the family of profile {profile!r} does not accept Modality.VIDEO"
    if case.get("skipped") and not strict_from_env(os.environ):
        return "the generator skipped a file of this case (no ffmpeg on this machine)"
    return None


def missing_files_reason(case: dict[str, Any]) -> str | None:
    """In CI, why a case whose files the generator skipped fails (rather than becoming an xfail), or None."""
    if case.get("skipped") and strict_from_env(os.environ):
        return (f"{case['id']}: the corpus generator skipped this case's files (no ffmpeg on PATH); "
                f"in CI that is a failure, not a pending case")
    return None


def data_url(name: str, data: bytes) -> str:
    mime = MIME.get(Path(name).suffix.lower(), "application/octet-stream")
    return f"data:{mime};base64," + base64.b64encode(data).decode()
