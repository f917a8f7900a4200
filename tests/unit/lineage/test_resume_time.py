"""Unit tests for the time-to-resume breakdown: every part present, the parts add up.

The attempt folders are written by hand the way the segment task, the launcher
and rank 0 write them; consistency is tested, never speed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from relay.lineage.resume_time import (
    PARTS,
    ResumeClock,
    complete_previous,
    fault_onset,
    note_launch,
    time_to_resume,
)
from relay_train.protocol.launch import FIRST_STEP_FILE

T0 = 1_800_000_000.0


def _faulty_attempt(seg: Path, *, injected: bool) -> Path:
    """Write try-1 as the faulty attempt's task leaves it; return its folder."""
    attempt = seg / "try-1"
    attempt.mkdir(parents=True)
    if injected:
        (attempt / "chaos.jsonl").write_text(
            json.dumps({"kind": "hang", "at": T0 + 0.4}) + "\n"
            + json.dumps({"kind": "straggler", "at": T0 + 0.2}) + "\n")
    clock = ResumeClock(fault_onset(attempt), detected_at=T0 + 3.5, woke_at=T0 + 4.25)
    for offset, part in zip((4.5, 5.0, 5.75, 6.5), ("decide", "rescue", "stop", "record"),
                            strict=True):
        clock.mark(part, T0 + offset)
    (attempt / "decision.json").write_text(json.dumps({"time_to_resume": clock.to_dict()}))
    return attempt


def _retry_attempt(seg: Path, *, standby: bool) -> Path:
    """Write try-2 as its task, the launcher and rank 0 leave it after the first step."""
    attempt = seg / "try-2"
    attempt.mkdir(parents=True)
    note_launch(attempt, T0 + 8.0, T0 + 8.5)
    (attempt / "handle.json").write_text(json.dumps(
        {"nodes": {"node-c": {"pid": 1, "pgid": 1, "standby": standby}}, "started_at": T0 + 9}))
    (attempt / FIRST_STEP_FILE).write_text(json.dumps({
        "step": 36, "at": T0 + 11.5, "node": "node-c", "spawned_at": T0 + 9.0,
        "startup": {"imports": 0.01, "rendezvous": 1.24, "restore": 0.3, "setup": 0.2,
                    "first step": 0.5}}))
    return attempt


@pytest.mark.parametrize("standby", [True, False])
def test_a_completed_breakdown_has_every_part_and_they_add_up(
    tmp_path: Path, standby: bool
) -> None:
    faulty = _faulty_attempt(tmp_path, injected=True)
    retry = _retry_attempt(tmp_path, standby=standby)

    done = complete_previous(retry)

    assert done is not None and done[0] == faulty
    result = done[1]
    assert list(result["parts"]) == list(PARTS)
    assert all(seconds is not None and seconds >= 0 for seconds in result["parts"].values())
    # The whole is the injected fault's first strike to the retry's first step, measured
    # independently of the parts; the parts must cover it with no gap and no overlap.
    assert result["total"] == pytest.approx(11.5 - 0.2)
    assert math.fsum(result["parts"].values()) == pytest.approx(result["total"], abs=0.01)
    assert result["parts"]["detect"] == pytest.approx(3.3)
    assert result["parts"]["rendezvous"] == pytest.approx(1.25)
    assert result["agent_start"] == ("standby claim" if standby else "agent start")
    on_disk = json.loads((faulty / "decision.json").read_text())["time_to_resume"]
    assert on_disk["complete"] and on_disk["total"] == result["total"]


def test_an_unknown_onset_starts_the_breakdown_at_detection(tmp_path: Path) -> None:
    _faulty_attempt(tmp_path, injected=False)

    done = complete_previous(_retry_attempt(tmp_path, standby=False))

    assert done is not None
    parts = done[1]["parts"]
    assert parts["detect"] is None
    assert done[1]["total"] == pytest.approx(11.5 - 3.5)
    assert math.fsum(s for s in parts.values() if s is not None) == pytest.approx(
        done[1]["total"], abs=0.01)


def test_the_breakdown_stays_incomplete_until_the_retry_steps(tmp_path: Path) -> None:
    faulty = _faulty_attempt(tmp_path, injected=True)
    retry = _retry_attempt(tmp_path, standby=False)
    (retry / FIRST_STEP_FILE).unlink()

    assert complete_previous(retry) is None
    partial = json.loads((faulty / "decision.json").read_text())["time_to_resume"]
    assert not partial["complete"] and partial["total"] is None
    assert list(partial["parts"]) == list(PARTS[:6])


def test_a_first_attempt_or_a_complete_breakdown_is_left_alone(tmp_path: Path) -> None:
    faulty = _faulty_attempt(tmp_path, injected=True)
    assert complete_previous(faulty) is None  # try-1 has no previous attempt
    retry = _retry_attempt(tmp_path, standby=False)
    assert complete_previous(retry) is not None
    assert complete_previous(retry) is None  # already complete: not logged twice


def test_marking_an_unknown_part_is_refused() -> None:
    clock = ResumeClock(None, T0, T0)
    with pytest.raises(ValueError, match="expected one of"):
        clock.mark("coffee", T0)


def test_the_worker_api_leaves_what_the_retry_marks_are_read_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real Session: rank 0's first_step.json carries its node, spawn time and phases."""
    from relay.lineage.resume_time import retry_marks
    from relay_train import api
    from relay_train.protocol.env import ENV_SPAWNED_AT
    from relay_train.protocol.launch import LaunchConfig

    monkeypatch.setenv(ENV_SPAWNED_AT, str(T0))
    cfg = LaunchConfig(
        job="t", seed=1, model={}, data={}, optimizer={}, start_step=35, end_step=40,
        checkpoint_every=5, nodes=["node-c"], ranks_per_node=1, master_addr="127.0.0.1",
        master_port=1, tracking_uri="sqlite:///unused.db", run_id="r",
        attempt_dir=str(tmp_path), attempt=2, segment=0, heartbeat_interval_seconds=0,
    )
    session = api.Session(cfg, rank=1, node="node-c")  # rank 1: no MLflow publisher...
    try:
        session.startup.mark("rendezvous")
        session.rank = 0  # ...but rank 0's first-step record
        session._first_step(35)
    finally:
        session._responder.close()
        session._evidence.close()
    note_launch(tmp_path, T0 - 1.0, T0 - 0.5)

    first = json.loads((tmp_path / FIRST_STEP_FILE).read_text())
    marks = retry_marks(tmp_path)

    assert (first["step"], first["node"], first["spawned_at"]) == (36, "node-c", T0)
    assert list(first["startup"]) == ["rendezvous", "first step"]
    assert marks is not None
    assert marks["agent_start"] == T0
    assert marks["rendezvous"] == pytest.approx(T0 + first["startup"]["rendezvous"])
    assert marks["first_step"] == first["at"] >= marks["rendezvous"]
    assert marks["agent_start_kind"] == "agent start"  # no launcher handle: not a standby


# -- the one definition ---------------------------------------------------------------


def test_time_to_resume_runs_from_the_onset_with_detection_as_its_own_part() -> None:
    found = time_to_resume(T0, T0 + 2.0, T0 + 5.6)

    assert (found.detect, found.after_detection) == (pytest.approx(2.0), pytest.approx(3.6))
    assert found.total == pytest.approx(5.6)  # not 3.6: detection is part of it
    assert found.describe() == "5.6s (detection 2.0s + 3.6s)"


def test_an_unknown_onset_or_no_first_step_yet_says_so() -> None:
    unknown = time_to_resume(None, T0 + 2.0, T0 + 5.6)
    assert unknown.detect is None and unknown.total == pytest.approx(3.6)
    assert "onset unknown" in unknown.describe()
    pending = time_to_resume(T0, T0 + 2.0, None)
    assert pending.detect == pytest.approx(2.0) and pending.total is None
    assert pending.describe() == "not resumed yet"


def test_the_breakdown_mlflow_logs_and_the_report_rows_agree(tmp_path: Path) -> None:
    """decision.json's total (what MLflow logs) is the one definition's, and so is the row
    `relay report` and the Recovery page show, read from the record or from the folders."""
    from types import SimpleNamespace

    from relay.lineage.report import _resumed

    faulty = _faulty_attempt(tmp_path, injected=True)
    retry = _retry_attempt(tmp_path, standby=False)
    done = complete_previous(retry)
    assert done is not None
    record = json.loads((faulty / "decision.json").read_text())
    record["fault"] = {"detected_at": T0 + 3.5}
    child = SimpleNamespace(info=SimpleNamespace(run_id="r1"),
                            data=SimpleNamespace(params={"attempt_dir": str(faulty)}))
    nxt = SimpleNamespace(data=SimpleNamespace(params={"attempt_dir": str(retry)}))

    from_record = _resumed(record, child, nxt)
    from_folders = _resumed({"fault": record["fault"]}, child, nxt)

    assert done[1]["total"] == from_record.total == from_folders.total
    assert from_record.total == pytest.approx(11.5 - 0.2)
    assert from_record.detect == from_folders.detect == pytest.approx(3.3)
