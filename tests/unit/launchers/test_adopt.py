"""Segment boundaries by adoption: the worker side (relay_train.boundary) and Relay's side
(relay.launchers.local.adopt, the watcher's boundary, relay.tools.bench.boundary_time), without
Airflow or torch ranks.

The whole path through Airflow and real DDP is tests/integration/test_segment_adoption.py.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from relay.core.attempt import Attempt, AttemptState
from relay.launchers import LaunchStatus
from relay.launchers.local import adopt
from relay.launchers.local.continuity import LocalContinuity
from relay.lineage.interval import INTERVAL_FILE
from relay.nodes.pool import NodePool
from relay.operators.base import end_run
from relay.tools.bench.boundary_time import RESTART_PARTS, boundaries
from relay.watch.observation import Observation
from relay.watch.triggers import SegmentWatchTrigger
from relay_train import boundary as boundary_module
from relay_train.boundary import Adoption, BoundaryKeeper
from relay_train.inject import ChaosMonkey
from relay_train.protocol.heartbeat import Heartbeat, HeartbeatWriter
from relay_train.protocol.launch import (
    ADOPT_FILE,
    BOUNDARIES_FILE,
    FIRST_STEP_FILE,
    RESULT_FILE,
    LaunchConfig,
)

CPU = torch.device("cpu")


def _cfg(root: Path, **changes: Any) -> LaunchConfig:  # noqa: ANN401
    fields: dict[str, Any] = {
        "job": "j", "seed": 1, "model": {}, "data": {}, "optimizer": {}, "start_step": 0,
        "end_step": 30, "checkpoint_every": 10, "nodes": ["node-a", "node-b"],
        "ranks_per_node": 1, "master_addr": "127.0.0.1", "master_port": 1, "tracking_uri": "x",
        "run_id": "run-0", "attempt_dir": str(root), "attempt": 2, "segment": 0,
        "boundaries": [30, 60, 90], "run_on_to": 60, "adopt_wait_seconds": 0.3,
    }
    fields.update(changes)
    root.mkdir(parents=True, exist_ok=True)
    return LaunchConfig(**fields)


def _adopt_file(root: Path, run_on_to: int, segment: int = 1, attempt: int = 3) -> None:
    (root / ADOPT_FILE).write_text(json.dumps(
        {"run_on_to": run_on_to, "run_id": f"run-{segment}", "segment": segment,
         "attempt": attempt}))


def test_steps_belong_to_the_segment_they_fall_in_and_to_the_adopting_try(tmp_path: Path) -> None:
    keeper = BoundaryKeeper(_cfg(tmp_path), rank=0)

    assert keeper.where(29) == (0, 2)  # its own segment and try
    assert keeper.where(30) == (1, 1)  # past its end, not adopted yet: segment 1's first try
    _adopt_file(tmp_path, 90, segment=1, attempt=3)
    assert keeper.poll() == Adoption(90, "run-1", 1, 3)
    assert keeper.where(35) == (1, 3)
    assert keeper.where(60) == (2, 1)
    assert keeper.poll() is None  # nothing new
    assert {30, 60, 90} <= keeper.checkpoint_steps()


def test_at_the_limit_an_adoption_lets_the_ranks_go_on_and_the_last_step_ends_them(
    tmp_path: Path,
) -> None:
    keeper = BoundaryKeeper(_cfg(tmp_path), rank=0)
    _adopt_file(tmp_path, 90)

    assert keeper.limit == 60
    assert keeper.agree(60, CPU) is True
    assert keeper.limit == 90
    assert keeper.agree(90, CPU) is False  # the job's last step: never waited at


def test_without_an_adoption_the_ranks_wait_the_bound_then_finish(tmp_path: Path) -> None:
    keeper = BoundaryKeeper(_cfg(tmp_path, adopt_wait_seconds=0.3), rank=0)

    started = time.monotonic()
    assert keeper.agree(60, CPU) is False
    assert time.monotonic() - started >= 0.3
    assert keeper.limit == 60


def test_a_later_segments_end_is_checkpointed_only_once_its_task_adopted_the_workload(
    tmp_path: Path,
) -> None:
    keeper = BoundaryKeeper(_cfg(tmp_path, adopt_wait_seconds=30.0), rank=0)
    assert keeper.owner_pending(30) is None  # its own segment's end: its own run
    assert keeper.owner_pending(45) is None  # not a segment end
    assert keeper.owner_pending(60) == 1
    writer = threading.Timer(0.2, _adopt_file, (tmp_path, 90, 1, 3))
    started = time.monotonic()
    writer.start()

    assert keeper.await_owner(60) is True
    assert 0.2 <= time.monotonic() - started < 30.0
    assert keeper.adoption == Adoption(90, "run-1", 1, 3)
    assert keeper.owner_pending(60) is None
    # The job's last step is segment 2's end: it waits for segment 2's task as well, so
    # the final checkpoint is in the last segment's run however fast the steps are.
    assert keeper.owner_pending(90) == 2
    _adopt_file(tmp_path, 90, segment=2, attempt=1)
    assert keeper.await_owner(90) is True and keeper.adoption.segment == 2


def _no_second_wait(seconds: float) -> None:
    raise AssertionError(f"waited again ({seconds} s) at a limit already waited at")


def test_a_task_that_never_comes_costs_one_bounded_wait_then_the_ranks_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    keeper = BoundaryKeeper(_cfg(tmp_path, adopt_wait_seconds=0.3), rank=0)

    started = time.monotonic()
    assert keeper.await_owner(60) is False  # the checkpoint goes to the earlier run
    assert time.monotonic() - started >= 0.3
    with monkeypatch.context() as patch:  # no second wait at the same limit
        patch.setattr(boundary_module, "time", SimpleNamespace(
            monotonic=time.monotonic, time=time.time, sleep=_no_second_wait))
        assert keeper.agree(60, CPU) is False
    keeper.record(60, stall=0.01, agreed=0.0)
    [entry] = [json.loads(line) for line in (tmp_path / BOUNDARIES_FILE).read_text().splitlines()]
    assert entry["agree"] >= 0.3  # the wait is part of what the boundary cost the loop


def test_a_workload_launched_to_stop_never_runs_on(tmp_path: Path) -> None:
    keeper = BoundaryKeeper(_cfg(tmp_path, run_on_to=None, boundaries=[]), rank=0)
    _adopt_file(tmp_path, 90)

    assert keeper.limit == 30
    assert keeper.poll() is None
    assert keeper.agree(30, CPU) is False


def test_chaos_follows_the_workload_into_the_next_segment(tmp_path: Path) -> None:
    fault = {"kind": "crash", "segment": 1, "step": 35, "rank": 0, "attempt": 1}
    monkey = ChaosMonkey([fault], segment=0, attempt=1, rank=0, node="node-a",
                         record_dir=tmp_path / "run" / "seg" / "try")

    assert monkey._due(35, ("crash",)) == []
    monkey.move_to(1, 1)
    assert [f.step for _i, f in monkey._due(35, ("crash",))] == [35]
    monkey.move_to(1, 2)  # a retry of segment 1: the fault was for its first try only
    assert monkey._due(35, ("crash",)) == []


# -- Relay's side ------------------------------------------------------------------------


class FakeLauncher:
    """A launcher whose attempts are in the states a test gives (no processes here)."""

    name = "local"

    def __init__(self, states: dict[Path, AttemptState]) -> None:
        self.states = states
        self.stopped: list[Path] = []

    def status(self, attempt: Attempt) -> LaunchStatus:
        return LaunchStatus(self.states.get(attempt.runs_in, AttemptState.COMPLETED), {})

    def stop(self, attempt: Attempt, grace_seconds: float = 5.0) -> list[str]:
        self.stopped.append(attempt.runs_in)
        return []


def _workload(run_dir: Path, segment: int, try_number: int, steps: list[int],
              **changes: Any) -> Path:  # noqa: ANN401
    root = run_dir / f"segment-{segment:03d}" / f"try-{try_number}"
    cfg = _cfg(root, segment=segment, attempt=try_number, **changes)
    cfg.write(root / "launch.json")
    (root / "handle.json").write_text("{}")
    for rank, step in enumerate(steps):
        writer = HeartbeatWriter(root / "heartbeats", rank, cfg.nodes[rank], 0.5, step=step)
        writer.flush_now()
    return root


def test_the_next_segment_finds_the_running_workload_and_may_adopt_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    old = _workload(run, 0, 1, [30, 30])
    time.sleep(0.01)
    live = _workload(run, 0, 2, [41, 42])
    launcher = FakeLauncher({old: AttemptState.COMPLETED, live: AttemptState.RUNNING})

    assert adopt.live_workload(run, 1, launcher) == live
    assert adopt.live_workload(run, 0, launcher) is None  # only earlier segments' workloads
    assert adopt.refusal(live, end=60, resume_step=40) is None
    assert "past this segment's end" in str(adopt.refusal(live, end=40, resume_step=40))
    adopt.let_go(live)
    assert adopt.live_workload(run, 1, launcher) is None  # stopped by Relay: never again


def test_a_workload_launched_to_stop_at_its_end_is_not_adopted(tmp_path: Path) -> None:
    live = _workload(tmp_path / "run", 0, 1, [12, 12], run_on_to=None)

    assert "to stop at its segment's end" in str(adopt.refusal(live, end=60, resume_step=10))


def test_adopting_records_both_sides_and_runs_on_only_when_in_time(tmp_path: Path) -> None:
    run = tmp_path / "run"
    early = _workload(run, 0, 1, [41, 42])
    record = run / "segment-001" / "try-1"

    at = adopt.adopt(record, early, run_id="r1", segment=1, attempt=1, resume_step=40, end=60,
                     next_end=90)

    assert at == 42
    assert json.loads((early / ADOPT_FILE).read_text())["run_on_to"] == 90
    assert adopt.workload_of(record) == early
    assert adopt.run_id_of(record) == "r1"
    view = adopt.attempt_view(record, LaunchConfig.read(early / "launch.json"))
    assert (view.run_id, view.segment, view.start_step, view.end_step) == ("r1", 1, 40, 60)
    assert adopt.watch_boundary(view, LaunchConfig.read(early / "launch.json")) == 60
    assert json.loads((record / FIRST_STEP_FILE).read_text())["adopted"] is True

    # Waiting at this segment's end (its rank 0 holds that checkpoint back for this
    # adoption): it may go on to the next segment's end, and waits there for that task.
    late = _workload(tmp_path / "run2", 0, 1, [60, 60])
    adopt.adopt(tmp_path / "run2" / "segment-001" / "try-1", late, run_id="r1", segment=1,
                attempt=1, resume_step=30, end=60, next_end=90)
    assert json.loads((late / ADOPT_FILE).read_text())["run_on_to"] == 90


def test_an_adopting_attempt_records_the_interval_it_keeps(tmp_path: Path) -> None:
    workload = _workload(tmp_path / "run", 0, 2, [41, 42])
    (workload / INTERVAL_FILE).write_text(json.dumps(
        {"steps": 10, "mode": "auto", "reason": "Young/Daly: 10 steps"}))
    record = tmp_path / "run" / "segment-001" / "try-1"

    params = adopt.kept_interval(workload, record, 10)

    kept = json.loads((record / INTERVAL_FILE).read_text())
    assert (kept["steps"], kept["mode"]) == (10, "auto")
    assert kept["reason"] == params["checkpoint_every_reason"]
    assert kept["reason"].startswith("kept from the adopted workload segment-000/try-2")
    assert kept["reason"].endswith("Young/Daly: 10 steps")
    assert params["checkpoint_every"] == "10"


def test_a_retry_stops_what_an_earlier_try_adopted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    workload = _workload(run, 0, 1, [41, 42])
    adopt.adopt(run / "segment-001" / "try-1", workload, run_id="r1", segment=1, attempt=1,
                resume_step=40, end=60, next_end=90)
    launcher = FakeLauncher({workload: AttemptState.RUNNING})

    adopt.stop_adopted(run / "segment-001", launcher)

    assert launcher.stopped == [workload]
    assert adopt.live_workload(run, 2, launcher) is None


def test_strikes_aimed_at_the_adopting_try_are_copied_to_its_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    workload = _workload(run, 0, 1, [41, 42])
    record = run / "segment-001" / "try-1"
    adopt.adopt(record, workload, run_id="r1", segment=1, attempt=1, resume_step=40, end=60,
                next_end=90)
    strikes = [{"kind": "hang", "segment": 0, "attempt": 1, "at": 1.0},
               {"kind": "hang", "segment": 1, "attempt": 1, "at": 2.0}]
    (workload / "chaos.jsonl").write_text("".join(json.dumps(s) + "\n" for s in strikes))

    adopt.copy_strikes(workload, record)

    copied = [json.loads(line) for line in (record / "chaos.jsonl").read_text().splitlines()]
    assert [s["at"] for s in copied] == [2.0]


def _beat(rank: int, step: int) -> Heartbeat:
    return Heartbeat(rank=rank, node="n", pid=1, step=step, phase="compute")


@pytest.mark.parametrize(("steps", "passed"), [
    ((60, 60), True), ((59, 60), False), ((60,), False),
    # Rank 1 finished step 60 (the boundary's own step): rank 0 ran it too, after crossing;
    # its heartbeat lags (its node froze just after, agent and all).
    ((59, 61), True), ((None, 61), True)])
def test_the_watcher_completes_once_every_rank_passed_the_boundary(
    steps: tuple[int | None, ...], passed: bool,
) -> None:
    trigger = SegmentWatchTrigger("/x", {"node-a": [0], "node-b": [1]}, boundary_step=60)
    beats = {r: _beat(r, s) for r, s in enumerate(steps) if s is not None}
    obs = Observation(now=time.time(), launched_at=0.0, heartbeats=beats,
                      node_ranks=trigger.node_ranks, heartbeat_interval=0.5)

    assert trigger.passed_boundary(obs) is passed
    assert trigger.serialize()[1]["boundary_step"] == 60


def test_rank_0s_record_of_crossing_the_boundary_counts_where_heartbeats_lag(
    tmp_path: Path,
) -> None:
    # A rank that crashed or froze just after the boundary keeps a heartbeat from before
    # it: the fault belongs to the next segment, whose task adopts and handles it. Rank 0's
    # record comes over the channel (LaunchStatus.crossed); the watcher reads no file.
    trigger = SegmentWatchTrigger(str(tmp_path), {"node-a": [0], "node-b": [1]},
                                  boundary_step=60)
    (tmp_path / BOUNDARIES_FILE).write_text(json.dumps({"step": 60}) + "\n")  # not read

    def observe(crossed: set[int] | None) -> Observation:
        launch = None if crossed is None else LaunchStatus(AttemptState.RUNNING, {},
                                                            crossed=crossed)
        return Observation(now=time.time(), launched_at=0.0,
                           heartbeats={0: _beat(0, 58), 1: _beat(1, 60)},
                           node_ranks=trigger.node_ranks, heartbeat_interval=0.5, launch=launch)

    assert trigger.passed_boundary(observe(None)) is False
    assert trigger.passed_boundary(observe(set())) is False
    assert trigger.passed_boundary(observe({30})) is False  # an earlier boundary
    assert trigger.passed_boundary(observe({30, 60})) is True


def test_a_restart_boundary_breaks_down_into_parts_that_add_up(tmp_path: Path) -> None:
    run = tmp_path / "run"
    before = _workload(run, 0, 1, [30, 30], run_on_to=None)
    (before / RESULT_FILE).write_text(json.dumps({"loop_ended_at": 100.0,
                                                  "published_at": 101.0}))
    (before / adopt.BOUNDARY_FILE).write_text(json.dumps(
        {"fired_at": 102.0, "woke_at": 103.0, "done_at": 104.5}))
    after = _workload(run, 1, 1, [30, 30], run_on_to=None)
    (after / "task.json").write_text(json.dumps({"task_started_at": 106.0,
                                                 "launch_called_at": 107.0}))
    (after / FIRST_STEP_FILE).write_text(json.dumps(
        {"at": 112.0, "spawned_at": 109.0, "startup": {"imports": 0.5, "rendezvous": 1.0}}))

    [row] = boundaries(run)

    assert row["kind"] == "restart"
    assert list(row["parts"]) == list(RESTART_PARTS)
    assert sum(row["parts"].values()) == pytest.approx(row["total"]) == 12.0
    assert row["parts"]["scheduling"] == pytest.approx(1.5)


def test_a_failed_dag_run_stops_the_workload_it_handed_over(tmp_path: Path) -> None:
    run = tmp_path / "run"
    running = _workload(run, 1, 1, [70, 70])
    done = _workload(run, 0, 1, [30, 30])
    launcher = FakeLauncher({running: AttemptState.RUNNING, done: AttemptState.COMPLETED})

    assert adopt.stop_run_workloads(run, launcher) == [running]
    assert launcher.stopped == [running]
    assert adopt.live_workload(run, 2, launcher) is None


def test_the_end_of_a_dag_run_stops_its_workloads_and_frees_its_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    pool = NodePool()
    assert pool.select(2, holder="relay_j/run-1") == ["node-a", "node-b"]
    run = tmp_path / "run"
    running = _workload(run, 1, 1, [70, 70])
    launcher = FakeLauncher({running: AttemptState.RUNNING})
    launcher.continuity = LocalContinuity(launcher)  # type: ignore[attr-defined]

    end_run(launcher, run, "relay_j/run-1", stop_workloads=True)  # type: ignore[arg-type]
    assert launcher.stopped == [running]
    assert pool.leases() == {}
    # The next DAG run is placed where an uninterrupted run would be.
    assert pool.select(2, holder="relay_j/run-2") == ["node-a", "node-b"]
    end_run(launcher, run, "relay_j/run-2", stop_workloads=False)  # type: ignore[arg-type]
    assert launcher.stopped == [running]  # a job that never hands over: only the lease ends
    assert pool.leases() == {}


class _NoCheckpointYet:
    """A lineage whose MLflow holds no manifest (the publisher froze before writing it)."""

    def __init__(self) -> None:
        self.client = self

    def list_artifacts(self, run_id: str, path: str) -> list[Any]:
        return []

    def has_checkpoint(self, parent: str, step: int) -> bool:
        return False


def test_waiting_for_a_boundary_checkpoint_ends_once_relay_stopped_the_workload(
    tmp_path: Path,
) -> None:
    workload = _workload(tmp_path / "run", 0, 1, [30, 30])
    adopt.let_go(workload)  # the freeze guard stopped it: nothing more will be published

    started = time.monotonic()
    assert adopt.wait_published(_NoCheckpointYet(), "p", "r", 30, 60.0, workload) is False
    assert time.monotonic() - started < 30.0  # not the whole checkpoint_timeout


def _wait_until_stopped(launcher: FakeLauncher, seconds: float = 30.0) -> None:
    """Give the freeze guard's thread its time, however busy the machine."""
    deadline = time.monotonic() + seconds
    while not launcher.stopped and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_freeze_guard_leaves_a_workload_this_task_adopted_to_its_watcher(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    workload = _workload(run, 0, 1, [52, 52])
    for beat in (workload / "heartbeats").iterdir():  # a frozen node: silent for a minute
        record = json.loads(beat.read_text())
        beat.write_text(json.dumps({**record, "wall_clock": time.time() - 60}))
    adopt.adopt(run / "segment-001" / "try-1", workload, run_id="r1", segment=1, attempt=1,
                resume_step=30, end=60, next_end=90)
    launcher = FakeLauncher({workload: AttemptState.RUNNING})

    with adopt.freeze_guard(run, 1, launcher, silent_seconds=2.0, grace_seconds=0.0):
        time.sleep(1.5)
    assert launcher.stopped == []  # segment 1's watcher judges the silence (node_unresponsive)
    with adopt.freeze_guard(run, 2, launcher, silent_seconds=2.0, grace_seconds=0.0):
        _wait_until_stopped(launcher)  # segment 2's task, before adopting: nobody watches it
    assert launcher.stopped == [workload]


def test_a_workload_the_freeze_guard_stopped_is_never_adopted(tmp_path: Path) -> None:
    """The guard marks the workload let go before stopping it: an adoption that comes
    while it stops (the task unblocked by that very stop) launches afresh instead."""
    run = tmp_path / "run"
    workload = _workload(run, 0, 1, [52, 52])
    for beat in (workload / "heartbeats").iterdir():
        record = json.loads(beat.read_text())
        beat.write_text(json.dumps({**record, "wall_clock": time.time() - 60}))
    launcher = FakeLauncher({workload: AttemptState.RUNNING})
    with adopt.freeze_guard(run, 1, launcher, silent_seconds=2.0, grace_seconds=0.0):
        _wait_until_stopped(launcher)
    assert launcher.stopped == [workload]
    record = run / "segment-001" / "try-1"
    assert adopt.adopt(record, workload, run_id="r1", segment=1, attempt=1, resume_step=30,
                       end=60, next_end=90) is None
    assert not (record / adopt.ADOPTED_FILE).exists()
    assert adopt.live_workload(run, 1, launcher) is None
