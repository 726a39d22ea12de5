"""Fixtures of the audio tests: the three audio bundles' processors, loaded once per session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from tests.audio.references import Processors


@pytest.fixture(scope="session")
def processors() -> Processors:
    return Processors()
