"""`relay bench detect --load`: its busy processes are stopped by PID, and its report counts
false alarms against precision as well as the false-alarm rate."""

from __future__ import annotations

import os
from typing import Any

import pytest

from relay.tools.bench.detect_load import oversubscribed, report


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_busy_processes_lead_their_own_sessions_and_are_stopped_by_pid() -> None:
    with oversubscribed(factor=1) as pids:
        assert len(pids) == (os.cpu_count() or 1)
        assert all(_alive(pid) for pid in pids)
        assert all(os.getsid(pid) == pid for pid in pids), "each leads its own session"
    assert not any(_alive(pid) for pid in pids)


def test_the_busy_processes_are_stopped_when_the_bench_fails() -> None:
    started: list[int] = []
    with pytest.raises(RuntimeError), oversubscribed(factor=1) as pids:
        started = pids
        raise RuntimeError("a trial failed")
    assert started and not any(_alive(pid) for pid in started)


def rec(ok: bool, kind: str, latency: float | None) -> dict[str, Any]:
    return {"ok": ok, "kind": kind, "latency": latency, "status": "faulted"}


def test_report_counts_false_alarms_against_precision(capsys: pytest.CaptureFixture[str]) -> None:
    trials = [("hang", rec(True, "hang", 1.0)), ("hang", rec(True, "hang", 2.0)),
              ("straggler", rec(True, "straggler", 2.5)),
              ("straggler", rec(False, "node_unresponsive", None))]
    alarms = [{"kind": "hang"}]
    assert report(1800.0, alarms, trials) is False
    out = capsys.readouterr().out
    assert "1 false alarm(s) = 2.0 per hour" in out
    hang = next(line for line in out.splitlines() if line.strip().startswith("hang"))
    assert hang.split()[1:5] == ["2/2", "0.67", "1.50s", "2.00s"]
    straggler = next(line for line in out.splitlines() if "straggler" in line)
    assert straggler.split()[1:3] == ["1/2", "1.00"]


def test_report_meets_the_goal_only_without_false_alarms_and_within_3_s() -> None:
    assert report(600.0, [], [("hang", rec(True, "hang", 2.9))]) is True
    assert report(600.0, [], [("hang", rec(True, "hang", 3.1))]) is False
