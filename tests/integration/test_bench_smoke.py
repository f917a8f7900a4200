"""The cheap benchmarks' smoke modes run and say what they compare (no figure is asserted).

`relay bench goodput --smoke`, `detect --smoke` and `overhead --smoke` take
minutes on 2 cores and are run by hand (see the README); `relay.tools.bench.prestart`
runs one short pair in `make test-slow`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import workload_processes

from relay.core.settings import REPO_ROOT

pytestmark = pytest.mark.integration


def _bench(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT / "plugins"), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "relay.tools.cli", "bench", *args], env=env,
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
    assert text.count("events: none (correct)") == 1
    assert "per poll" in text


@pytest.mark.slow  # three fault runs of ~10 s each: `make test-slow`
def test_watcher_bench_names_every_scripted_fault_and_its_culprit() -> None:
    text = _bench("watcher", "--nodes", "8", "--seconds", "2")

    assert "events: none (correct)" in text
    for fault in ("frozen node", "hang", "straggler"):
        assert f"{fault}" in text
    assert "detected after" in text
    assert "WRONG" not in text and "not detected" not in text


@pytest.mark.slow  # two short runs through airflow dags test: `make test-slow`
def test_prestart_bench_runs_a_pair_and_prints_both_sides(tmp_path: Path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT / "plugins"), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "relay.tools.bench.prestart", "40", "1"], env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "prestart" in line and "wall" in line]
    assert len(lines) == 2 and "prestart on " in lines[0] and "prestart off" in lines[1], lines
    assert all("exit 0" in line and "Relay" in line for line in lines), lines
    deadline = time.monotonic() + 30  # the last resident was sent SIGTERM as the bench ended
    while left := workload_processes(tmp_path):
        assert time.monotonic() < deadline, f"outlived the bench: {left}"
        time.sleep(0.1)
