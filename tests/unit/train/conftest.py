"""Fixtures shared by the worker side's unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from residents import ResidentRun

from relay_train.agent import resident
from relay_train.agent.resident import RESIDENT_DIR, Resident


@pytest.fixture
def resident_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ResidentRun:
    """A resident that checks often, preloads nothing and leaves pytest's SIGTERM alone."""
    monkeypatch.setattr(resident, "IDLE_CHECK_SECONDS", 0.05)
    monkeypatch.setattr(resident.signal, "signal", lambda *_: None)  # pytest's own SIGTERM
    monkeypatch.setattr(Resident, "preload", lambda self: 0.0)
    directory = tmp_path / RESIDENT_DIR
    directory.mkdir()
    return ResidentRun(tmp_path, directory)
