"""Fixtures of the video tests: the parity corpus of clips, generated once per session with PyAV."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest

from tests.video.video_support import CLIPS, make_clip


@pytest.fixture(scope="session")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Clip name -> file (``video_support.CLIPS``)."""
    folder = tmp_path_factory.mktemp("clips")
    return {spec.name: make_clip(spec, folder) for spec in CLIPS}
