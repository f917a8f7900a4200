"""The cheap benchmarks' smoke modes run and say what they compare (no figure is asserted).

`relay bench goodput --smoke`, `detect --smoke` and `overhead --smoke` take
minutes on 2 cores and are run by hand (see the README).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relay.settings import REPO_ROOT

pytestmark = pytest.mark.integration


def _bench(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT / "plugins"), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "relay.cli", "bench", *args], env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_checkpoint_smoke_runs_both_blocks_and_says_what_it_compares() -> None:
    text = _bench("checkpoint", "--smoke")

    assert "a sync block, then an async block" in text
    assert "Compared:" in text
    assert "training step, async save in flight" in text


def test_watcher_smoke_stays_silent_on_healthy_ranks() -> None:
    text = _bench("watcher", "--smoke")

    assert "Compared with: one core" in text
    assert text.count("events: none") == 2
