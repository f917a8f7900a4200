"""A retry finishing the record of a try killed mid-record (the file store: no Airflow)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from relay.core.attempt import Attempt, AttemptState
from relay.core.exceptions import IllegalTransitionError
from relay.core.faults import Fault, FaultKind
from relay.launchers import launch_record
from relay.launchers.local.launcher import HANDLE_FILE, LocalLauncher, agent_handle
from relay.recover import journal
from relay.recover.evidence import RECEIVED_DIR
from relay.recover.save_state import from_warden
from relay.recover.warden_record import Stopped
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig
from relay_train.protocol.stacks_files import answer_path, faulthandler_path


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
HERE = (LocalLauncher(), "sqlite:///unused.db")  # the launcher and tracking URI of this "worker"


def test_a_retry_finishes_the_record_once(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path)
    journal.write({}, attempt.parent, AttemptState.HANDLING, attempt_dir=str(attempt),
                  fault=HANG.to_event()["fault"])
    calls: list[Fault] = []

    def handle(interrupted: Attempt, fault: Fault, cfg: LaunchConfig) -> str:
        calls.append(fault)
        assert not interrupted.adopted  # the try launched its workload itself
        journal.write({}, attempt.parent, AttemptState.RECORDED,
                      attempt_dir=str(interrupted.runs_in))
        return "recorded"

    assert journal.finish_interrupted({}, attempt.parent, handle, *HERE) == "recorded"
    assert journal.finish_interrupted({}, attempt.parent, handle, *HERE) is None
    assert [f.kind for f in calls] == [FaultKind.HANG]


def test_a_recorded_attempt_never_goes_back_to_handling(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path)
    journal.write({}, attempt.parent, AttemptState.RUNNING, attempt_dir=str(attempt))
    journal.write({}, attempt.parent, AttemptState.HANDLING, attempt_dir=str(attempt),
                  fault=HANG.to_event()["fault"])
    journal.write({}, attempt.parent, AttemptState.RECORDED, attempt_dir=str(attempt))
    with pytest.raises(IllegalTransitionError, match="recorded, which cannot become handling"):
        journal.write({}, attempt.parent, AttemptState.HANDLING, attempt_dir=str(attempt))
    # The next try's attempt starts its own life.
    retry = attempt.with_name("try-2")
    journal.write({}, attempt.parent, AttemptState.RUNNING, attempt_dir=str(retry))


def test_a_try_that_adopted_a_workload_is_finished_in_its_own_folder(tmp_path: Path) -> None:
    """Seen in `relay bench goodput`: segment 2's try adopted segment 1's workload and died
    while recording a straggler; the retry wrote the decision into segment 1's folder."""
    workload = _attempt(tmp_path)
    own = tmp_path / "segment-001" / "try-1"
    own.mkdir(parents=True)
    journal.write({}, own.parent, AttemptState.HANDLING, attempt_dir=str(workload),
                  record_dir=str(own), fault=HANG.to_event()["fault"])
    seen: list[Attempt] = []

    def handle(interrupted: Attempt, fault: Fault, cfg: LaunchConfig) -> None:
        seen.append(interrupted)

    journal.finish_interrupted({}, own.parent, handle, *HERE)
    assert seen == [Attempt(own, workload)]


def test_a_record_that_cannot_be_finished_does_not_fail_every_later_try(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path)
    journal.write({}, attempt.parent, AttemptState.HANDLING, attempt_dir=str(attempt),
                  fault=HANG.to_event()["fault"])

    def broken(interrupted: Attempt, fault: Fault, cfg: LaunchConfig) -> None:
        raise TypeError("a bug in the fault path")

    assert journal.finish_interrupted({}, attempt.parent, broken, *HERE) is None
    entry = journal.read({}, attempt.parent)
    assert entry is not None and entry["state"] == AttemptState.RECORDED and entry["error"]
    assert journal.finish_interrupted({}, attempt.parent, broken, *HERE) is None


def test_a_wardens_evidence_is_read_back_without_asking_any_agent(tmp_path: Path) -> None:
    attempt = _attempt(tmp_path)
    folder = attempt / RECEIVED_DIR
    answer_path(folder, 0).parent.mkdir(parents=True, exist_ok=True)
    answer_path(folder, 0).write_text(json.dumps({"rank": 0, "threads": []}))
    faulthandler_path(folder, 1).write_text("Thread 0x1 (most recent call first):\n")
    stopped = Stopped(by="warden", detected_at=1000.0, stopped_at=1031.0,
                                 step="rescue", survivors=[],
                                 evidence_request={"id": "x", "ranks": [0, 1]})
    decision = type("D", (), {"checkpoint_first": False, "retry": True, "rollback": False})()
    saved = from_warden(stopped, decision, HANG, attempt)
    evidence, drained, rescued = saved.evidence, saved.drained_at, saved.rescued
    assert evidence is not None and list(evidence.answers) == [0]
    assert list(evidence.fallback_stacks) == [1] and evidence.missing == []
    assert drained is None and rescued is None


def test_a_retry_on_another_machine_finishes_the_record_from_the_journal_alone(
        tmp_path: Path) -> None:
    # The try that launched the attempt ran elsewhere: neither launch.json nor handle.json
    # is on this machine. The journal entry's launch record is all the retry gets.
    attempt = _attempt(tmp_path)
    cfg = LaunchConfig.read(attempt / LAUNCH_FILE)
    handle = {"nodes": {"node-a": {"pid": 1, "pgid": 1, "started": None, "port": 4242}},
              "started_at": 123.0, "attempt_id": "seg/try-1"}
    (attempt / HANDLE_FILE).write_text(json.dumps(handle))
    record = launch_record.build(cfg, LocalLauncher())
    (attempt / LAUNCH_FILE).unlink()
    (attempt / HANDLE_FILE).unlink()
    journal.write({}, attempt.parent, AttemptState.HANDLING, attempt_dir=str(attempt),
                  fault=HANG.to_event()["fault"], **{launch_record.KEY: record})
    seen: list[LaunchConfig] = []
    launcher = LocalLauncher()

    def handle_fault(interrupted: Attempt, fault: Fault, found: LaunchConfig) -> Attempt:
        seen.append(found)
        return interrupted

    assert journal.finish_interrupted({}, attempt.parent, handle_fault, launcher,
                                      "sqlite:///here.db") == Attempt(attempt, attempt)
    assert record["launch"]["tracking_uri"] == ""  # a URI may carry credentials: never stored
    assert seen[0].run_id == "r1" and seen[0].nodes == ["node-a", "node-b"]
    assert seen[0].tracking_uri == "sqlite:///here.db"  # this worker's settings fill it in
    assert launcher.started_at(Attempt(attempt)) == 123.0  # the handle travelled too
    assert launcher.channel(Attempt(attempt)).addresses == {"node-a": "http://127.0.0.1:4242"}
    assert launcher.channel(Attempt(attempt)).attempt_id == "seg/try-1"
    assert not (attempt / LAUNCH_FILE).exists()


class Store:
    """Airflow's task state store as a task sees it (get/set of JSON values), in memory."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}

    def get(self, key: str, default: object = None) -> object:
        return json.loads(json.dumps(self.values[key])) if key in self.values else default

    def set(self, key: str, value: object) -> None:
        self.values[key] = json.loads(json.dumps(value))


def test_fault_history_comes_from_the_task_state_store_counting_each_attempt_once(
        tmp_path: Path) -> None:
    # The retry runs on a machine that never saw the earlier attempts' folders.
    context = {"task_state_store": Store()}
    seg = tmp_path / "segment-000"
    journal.note_fault(context, seg / "try-1", FaultKind.HANG)
    journal.note_fault(context, seg / "try-2", FaultKind.CRASH)
    journal.note_fault(context, seg / "try-2", FaultKind.CRASH)  # its record finished again
    assert not seg.exists()
    assert journal.fault_history(context, seg) == [FaultKind.HANG, FaultKind.CRASH]
    assert journal.fault_history(context, seg, exclude=seg / "try-2") == [FaultKind.HANG]


def test_without_a_task_state_store_the_folders_decisions_are_the_history(
        tmp_path: Path) -> None:
    seg = tmp_path / "segment-000"
    (seg / "try-1").mkdir(parents=True)
    (seg / "try-1" / "decision.json").write_text(json.dumps({"fault": {"kind": "nan_loss"}}))
    journal.note_fault({}, seg / "try-1", FaultKind.NAN_LOSS)  # nothing to keep it in: no-op
    assert journal.fault_history({}, seg) == [FaultKind.NAN_LOSS]


def test_the_store_and_this_machines_folders_each_count_an_attempt_once(tmp_path: Path) -> None:
    context = {"task_state_store": Store()}
    seg = tmp_path / "segment-000"
    for n, kind in ((1, "crash"), (2, "hang")):  # try 1 recorded before the store was used
        (seg / f"try-{n}").mkdir(parents=True)
        (seg / f"try-{n}" / "decision.json").write_text(json.dumps({"fault": {"kind": kind}}))
    journal.note_fault(context, seg / "try-2", FaultKind.HANG)
    journal.note_fault(context, seg / "try-3", FaultKind.NAN_LOSS)  # on another machine
    assert journal.fault_history(context, seg) == [
        FaultKind.CRASH, FaultKind.HANG, FaultKind.NAN_LOSS]


def test_a_retry_elsewhere_stops_what_a_killed_try_launched(tmp_path: Path) -> None:
    # The killed try's machine kept handle.json; this one has only the journal's record.
    attempt = _attempt(tmp_path)
    cfg = LaunchConfig.read(attempt / LAUNCH_FILE)
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        (attempt / HANDLE_FILE).write_text(json.dumps(
            {"nodes": {"node-a": agent_handle(proc.pid)}, "started_at": 1.0}))
        record = launch_record.build(cfg, LocalLauncher())
        (attempt / HANDLE_FILE).unlink()
        journal.write({}, attempt.parent, AttemptState.RUNNING, attempt_dir=str(attempt),
                      **{launch_record.KEY: record})
        assert journal.stop_launched({}, attempt.parent, LocalLauncher(),
                                     f"sqlite:///{tmp_path / 'x.db'}") == []
        assert proc.wait(timeout=30) is not None
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_observation_made_on_one_worker_is_known_to_the_next(tmp_path: Path) -> None:
    """Observe mode: the watcher that goes on (and the worker that ends the attempt) may
    run on another machine: the observed kind stays off, and its record is logged once."""
    from relay.policy.observe import observations, watched_kinds

    context = {"task_state_store": Store()}
    here, there = tmp_path / "a" / "try-1", tmp_path / "b" / "try-1"
    here.mkdir(parents=True)
    there.mkdir(parents=True)
    record = {"fault": {"kind": "straggler", "detected_at": 1.0}, "mode": "observe"}
    (here / "observed-001.json").write_text(json.dumps(record))  # what record_observation wrote
    journal.note_observation(context, here, record)

    stored = journal.observations(context, here)
    assert stored == [record]
    assert observations(here, stored) == [record]  # the folder's copy is not counted twice
    assert journal.observations(context, there) == []  # another attempt: not its record
    other = {"task_state_store": context["task_state_store"]}
    assert "straggler" not in watched_kinds(there, journal.observations(other, here))
    assert "straggler" in watched_kinds(there, journal.observations(other, there))
    assert journal.observations({}, here) is None  # no store: the folder's files are the record
