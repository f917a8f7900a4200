"""A retry finishing the record of a try killed mid-record (the file store: no Airflow)."""

from __future__ import annotations

import json
from pathlib import Path

from relay import journal, unattended
from relay.evidence import RECEIVED_DIR
from relay.faults import Fault, FaultKind
from relay.recovery import SegmentFaultError
from relay_train.evidence import answer_path, faulthandler_path
from relay_train.launch import LAUNCH_FILE, LaunchConfig


def _attempt(tmp_path: Path) -> Path:
    attempt = tmp_path / "segment-000" / "try-1"
    attempt.mkdir(parents=True)
    LaunchConfig(
        job="j", seed=0, model={}, data={}, optimizer={}, start_step=0, end_step=20,
        checkpoint_every=10, nodes=["node-a", "node-b"], ranks_per_node=1,
        master_addr="127.0.0.1", master_port=1, tracking_uri="sqlite:///unused.db",
        run_id="r1", attempt_dir=str(attempt), attempt=1, segment=0,
    ).write(attempt / LAUNCH_FILE)
    return attempt


HANG = Fault(FaultKind.HANG, 1, "node-b", {"summary": "stalled"}, 1000.0)


def test_a_retry_finishes_the_record_once(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path)
    journal.write({}, attempt.parent, journal.HANDLING, attempt_dir=str(attempt),
                  fault=HANG.to_event()["fault"])
    calls: list[Fault] = []

    def handle(fault: Fault, where: Path, own: Path, cfg: LaunchConfig) -> None:
        calls.append(fault)
        assert own == where  # the try launched its workload itself
        journal.write({}, attempt.parent, journal.RECORDED, attempt_dir=str(where))
        raise SegmentFaultError("recorded", None)  # type: ignore[arg-type]

    assert journal.finish_interrupted({}, attempt.parent, handle) == attempt
    assert journal.finish_interrupted({}, attempt.parent, handle) is None
    assert [f.kind for f in calls] == [FaultKind.HANG]


def test_a_try_that_adopted_a_workload_is_finished_in_its_own_folder(tmp_path: Path) -> None:
    """Seen in `relay bench goodput`: segment 2's try adopted segment 1's workload and died
    while recording a straggler; the retry wrote the decision into segment 1's folder."""
    workload = _attempt(tmp_path)
    own = tmp_path / "segment-001" / "try-1"
    own.mkdir(parents=True)
    journal.write({}, own.parent, journal.HANDLING, attempt_dir=str(workload),
                  record_dir=str(own), fault=HANG.to_event()["fault"])
    seen: list[tuple[Path, Path]] = []

    def handle(fault: Fault, where: Path, record: Path, cfg: LaunchConfig) -> None:
        seen.append((where, record))
        raise SegmentFaultError("recorded", None)  # type: ignore[arg-type]

    assert journal.finish_interrupted({}, own.parent, handle) == workload
    assert seen == [(workload, own)]


def test_a_record_that_cannot_be_finished_does_not_fail_every_later_try(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path)
    journal.write({}, attempt.parent, journal.HANDLING, attempt_dir=str(attempt),
                  fault=HANG.to_event()["fault"])

    def broken(fault: Fault, where: Path, own: Path, cfg: LaunchConfig) -> None:
        raise TypeError("a bug in the fault path")

    assert journal.finish_interrupted({}, attempt.parent, broken) == attempt
    entry = journal.read({}, attempt.parent)
    assert entry is not None and entry["stage"] == journal.RECORDED and entry["error"]
    assert journal.finish_interrupted({}, attempt.parent, broken) is None


def test_a_wardens_evidence_is_read_back_without_asking_any_agent(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path)
    folder = attempt / RECEIVED_DIR
    answer_path(folder, 0).parent.mkdir(parents=True, exist_ok=True)
    answer_path(folder, 0).write_text(json.dumps({"rank": 0, "threads": []}))
    faulthandler_path(folder, 1).write_text("Thread 0x1 (most recent call first):\n")
    stopped = unattended.Stopped(by="warden", detected_at=1000.0, stopped_at=1031.0,
                                 step="rescue", survivors=[],
                                 evidence_request={"id": "x", "ranks": [0, 1]})
    decision = type("D", (), {"checkpoint_first": False, "retry": True, "rollback": False})()
    evidence, drained, rescued = unattended.results(stopped, decision, HANG, attempt)
    assert evidence is not None and list(evidence.answers) == [0]
    assert list(evidence.fallback_stacks) == [1] and evidence.missing == []
    assert drained is None and rescued is None
