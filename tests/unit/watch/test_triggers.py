"""Unit tests for crash classification and the segment watcher trigger."""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
from agents import SERVED, close_served_agents, serve  # noqa: F401 - the fixture closes them
from airflow.triggers.base import TriggerEvent

from relay.core.attempt import Attempt, AttemptState
from relay.core.faults import Fault, FaultKind
from relay.launchers.local.launcher import HANDLE_FILE, LaunchStatus, LocalLauncher, NodeStatus
from relay.watch import triggers
from relay.watch.exits import classify_exit
from relay.watch.observation import Observation
from relay.watch.triggers import (
    DUE_MARGIN_SECONDS,
    DUE_MIN_PAUSE_SECONDS,
    FINISHING_FOR_SECONDS,
    FINISHING_POLL_SECONDS,
    SegmentWatchTrigger,
    finishing,
    next_pause,
)
from relay_train.protocol.heartbeat import Heartbeat, Phase, heartbeat_path, write_atomically
from relay_train.protocol.launch import attempt_id_of
from relay_train.protocol.pids import start_time
from relay_train.protocol.routes import NodeState

NODE_RANKS = {"node-a": [0, 1], "node-b": [2, 3]}
Record = tuple[NodeState, dict[int, int | None]]  # (state, exit codes by rank)


def failed_status() -> LaunchStatus:
    # node-b's rank 3 was SIGKILLed; everyone else went down with it.
    return LaunchStatus(
        AttemptState.FAILED,
        {
            "node-a": NodeStatus("node-a", NodeState.FAILED, {0: 1, 1: -15}),
            "node-b": NodeStatus("node-b", NodeState.FAILED, {2: 1, 3: -9}),
        },
    )


def test_classify_exit_names_the_sigkilled_rank_and_its_node() -> None:
    fault = classify_exit(failed_status(), NODE_RANKS)

    assert fault is not None
    assert fault.kind is FaultKind.CRASH
    assert fault.culprit_rank == 3
    assert fault.culprit_node == "node-b"
    assert fault.evidence["exit_codes"] == {0: 1, 1: -15, 2: 1, 3: -9}
    assert "rank 3 exited with code -9" in fault.evidence["summary"]
    assert fault.describe().startswith("crash (node node-b, rank 3)")


def test_classify_exit_with_only_secondary_exits_picks_the_lowest_rank() -> None:
    status = LaunchStatus(
        AttemptState.FAILED,
        {
            "node-a": NodeStatus("node-a", NodeState.FAILED, {0: -15, 1: -15}),
            "node-b": NodeStatus("node-b", NodeState.FAILED, {2: 1, 3: -15}),
        },
    )

    fault = classify_exit(status, NODE_RANKS)

    assert fault is not None
    assert (fault.culprit_rank, fault.culprit_node) == (0, "node-a")


def test_classify_exit_of_a_dead_agent_names_its_node() -> None:
    status = LaunchStatus(
        AttemptState.FAILED,
        {
            "node-a": NodeStatus("node-a", NodeState.RUNNING, {0: None, 1: None}),
            "node-b": NodeStatus(
                "node-b", NodeState.FAILED, detail="agent died without a final status (killed?)"
            ),
        },
    )

    fault = classify_exit(status, NODE_RANKS)

    assert fault is not None
    assert fault.kind is FaultKind.CRASH
    assert fault.culprit_rank is None
    assert fault.culprit_node == "node-b"
    assert "agent died" in fault.evidence["summary"]


@pytest.mark.parametrize("state", [AttemptState.COMPLETED, AttemptState.RUNNING])
def test_classify_exit_is_none_unless_failed(state: AttemptState) -> None:
    status = LaunchStatus(state, failed_status().nodes)  # even with bad codes on record

    assert classify_exit(status, NODE_RANKS) is None


def test_fault_event_round_trip() -> None:
    fault = classify_exit(failed_status(), NODE_RANKS)
    assert fault is not None

    payload = fault.to_event()

    assert payload["status"] == "faulted"
    assert payload["fault"]["kind"] == "crash"
    assert Fault.from_event(payload["fault"]) == fault


# --- the trigger ---------------------------------------------------------------------


def test_serialize_round_trip(tmp_path: Path) -> None:
    original = SegmentWatchTrigger(str(tmp_path), NODE_RANKS, poll_interval_seconds=0.25)

    classpath, kwargs = original.serialize()
    module, _, name = classpath.rpartition(".")
    cls = getattr(importlib.import_module(module), name)

    assert cls is SegmentWatchTrigger
    json.dumps(kwargs)  # the triggerer stores these: they must be plain data
    rebuilt = cls(**kwargs)
    assert rebuilt.serialize() == original.serialize()
    assert (rebuilt.attempt_dir, rebuilt.node_ranks, rebuilt.poll_interval_seconds) == (
        str(tmp_path),
        NODE_RANKS,
        0.25,
    )


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=10)
    return proc.pid


def fabricate(root: Path, records: dict[str, Record]) -> Path:
    """An attempt whose agents are real channel servers in 'this process' (alive)."""
    root.mkdir(parents=True, exist_ok=True)
    served = serve(root, NODE_RANKS)
    # pid: this test process, so agents count as alive. pgid: a reaped process, so
    # nothing could ever signal this test's own group through this handle.
    ids = {"pid": os.getpid(), "pgid": dead_pid(), "started": start_time(os.getpid())}
    handle = {"nodes": {node: {**ids, "port": int(served.addresses[node].rsplit(":", 1)[1])}
                        for node in NODE_RANKS},
              "started_at": time.time(), "attempt_id": attempt_id_of(root)}
    (root / HANDLE_FILE).write_text(json.dumps(handle))
    write_records(root, records)
    return root


def write_records(root: Path, records: dict[str, Record]) -> None:
    """Make the nodes' agents say ``records`` over the channel from now on."""
    for node, (state, codes) in records.items():
        agent = SERVED[root].nodes[node]
        agent.state, agent.exit_codes = state, dict(codes)


async def first_event(trigger: SegmentWatchTrigger, timeout: float = 10.0) -> TriggerEvent:
    events = trigger.run()
    try:
        return await asyncio.wait_for(events.__anext__(), timeout)
    finally:
        await events.aclose()


def watch(root: Path, detection: dict[str, float] | None = None) -> SegmentWatchTrigger:
    return SegmentWatchTrigger(str(root), NODE_RANKS, detection, poll_interval_seconds=0.02)


def test_run_fires_completed_when_every_node_succeeded(tmp_path: Path) -> None:
    root = fabricate(
        tmp_path / "try-1",
        {"node-a": (NodeState.SUCCEEDED, {0: 0, 1: 0}),
         "node-b": (NodeState.SUCCEEDED, {2: 0, 3: 0})},
    )

    event = asyncio.run(first_event(watch(root)))

    assert isinstance(event, TriggerEvent)
    assert event.payload == {"status": "completed", "attempt_dir": str(root)}


def test_a_nan_the_ranks_outran_is_still_reported(tmp_path: Path) -> None:
    """The ranks finished 5 steps after rank 1's loss went NaN, before any poll saw it."""
    root = fabricate(
        tmp_path / "try-1",
        {"node-a": (NodeState.SUCCEEDED, {0: 0, 1: 0}),
         "node-b": (NodeState.SUCCEEDED, {2: 0, 3: 0})},
    )
    write_training_heartbeats(root, step=30)
    beat = Heartbeat(rank=1, node="node-a", pid=1, step=30, phase="done", loss=math.nan,
                     nonfinite_step=25)
    write_atomically(heartbeat_path(root / "heartbeats", 1), beat.to_json())

    event = asyncio.run(first_event(watch(root)))

    assert event.payload["status"] == "faulted"
    fault = event.payload["fault"]
    assert (fault["kind"], fault["culprit_rank"], fault["evidence"]["step"]) == ("nan_loss", 1, 25)


def test_the_watcher_finds_the_agents_through_the_launch_record_it_was_given(
        tmp_path: Path) -> None:
    # The triggerer is another machine: no handle.json there, only the trigger's arguments.
    root = fabricate(
        tmp_path / "try-1",
        {"node-a": (NodeState.FAILED, {0: 1, 1: -15}),
         "node-b": (NodeState.FAILED, {2: 1, 3: -9})},
    )
    write_training_heartbeats(root)
    record = {"launch": {"attempt_dir": str(root)},
              "handle": json.loads((root / HANDLE_FILE).read_text())}
    (root / HANDLE_FILE).unlink()
    trigger = SegmentWatchTrigger(str(root), NODE_RANKS, poll_interval_seconds=0.02,
                                  launch_record=record)
    rebuilt = SegmentWatchTrigger(**trigger.serialize()[1])

    event = asyncio.run(first_event(rebuilt))

    fault = event.payload["fault"]  # the agents' exit codes, asked at their recorded ports
    assert (fault["kind"], fault["culprit_rank"], fault["culprit_node"]) == ("crash", 3, "node-b")
    assert event.payload["launch_record"] == record  # back to execute_complete, wherever


def write_training_heartbeats(root: Path, step: int = 5, age: float = 0.0) -> None:
    """Every rank past start-up: a later death is a crash, not a failed launch. ``age``:
    how long ago the beats were written."""
    folder = root / "heartbeats"
    folder.mkdir(parents=True, exist_ok=True)
    for node, ranks in NODE_RANKS.items():
        for rank in ranks:
            beat = Heartbeat(rank=rank, node=node, pid=1, step=step, phase="compute",
                             wall_clock=time.time() - age)
            write_atomically(heartbeat_path(folder, rank), beat.to_json())


def test_run_fires_a_crash_fault_naming_the_culprit(tmp_path: Path) -> None:
    root = fabricate(
        tmp_path / "try-1",
        {"node-a": (NodeState.FAILED, {0: 1, 1: -15}),
         "node-b": (NodeState.FAILED, {2: 1, 3: -9})},
    )
    write_training_heartbeats(root)
    before = time.time()

    event = asyncio.run(first_event(watch(root)))

    payload = event.payload
    assert payload["status"] == "faulted"
    assert payload["attempt_dir"] == str(root)
    fault = payload["fault"]
    assert fault["kind"] == "crash"
    assert (fault["culprit_rank"], fault["culprit_node"]) == (3, "node-b")
    assert fault["detected_at"] >= before
    assert Fault.from_event(fault).kind is FaultKind.CRASH


def test_run_keeps_watching_while_running_then_reports(tmp_path: Path) -> None:
    root = fabricate(
        tmp_path / "try-1",
        {"node-a": (NodeState.RUNNING, {0: None, 1: None}),
         "node-b": (NodeState.RUNNING, {2: None, 3: None})},
    )
    write_training_heartbeats(root)

    async def scenario() -> tuple[bool, TriggerEvent]:
        # beats written once: only the crash may end the watch, however slow the machine
        patient = {"heartbeat_timeout": 60.0, "hang_timeout": 60.0}
        task = asyncio.create_task(first_event(watch(root, patient)))
        await asyncio.sleep(0.2)  # ten polls of a running workload
        fired_early = task.done()
        write_records(root, {"node-a": (NodeState.FAILED, {0: -9, 1: -15})})
        return fired_early, await task

    fired_early, event = asyncio.run(scenario())

    assert not fired_early
    assert event.payload["status"] == "faulted"
    assert event.payload["fault"]["kind"] == "crash"
    assert event.payload["fault"]["culprit_rank"] == 0
    assert event.payload["fault"]["culprit_node"] == "node-a"


def test_run_fires_an_error_event_when_status_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "try-1"
    root.mkdir()

    def broken_status(self: LocalLauncher, _root: Path) -> None:
        raise TypeError("status file from the future")

    monkeypatch.setattr(LocalLauncher, "status", broken_status)

    event = asyncio.run(first_event(watch(root)))

    payload = event.payload
    assert payload["status"] == "failed"
    assert payload["attempt_dir"] == str(root)
    assert payload["message"].startswith("TypeError:")
    assert "Traceback" in payload["traceback"]
    assert "broken_status" in payload["traceback"]


def test_status_of_a_malformed_handle_is_failed_not_an_exception(tmp_path: Path) -> None:
    root = tmp_path / "try-1"
    root.mkdir()
    (root / HANDLE_FILE).write_text(json.dumps({"nodes": 5, "started_at": time.time()}))

    assert LocalLauncher().status(Attempt(root)).state is AttemptState.FAILED
    assert LocalLauncher().stop(Attempt(root)) == []


def _observed(phases: dict[int, Phase]) -> Observation:
    beats = {r: Heartbeat(rank=r, node="node-a" if r < 2 else "node-b", pid=1, step=40,
                          phase=p.value) for r, p in phases.items()}
    return Observation(now=time.time(), launched_at=time.time() - 60, heartbeats=beats,
                       node_ranks=NODE_RANKS, heartbeat_interval=0.5)


def test_the_watcher_sees_the_ranks_finishing_only_once_every_loop_ended() -> None:
    assert finishing(_observed(dict.fromkeys(range(4), Phase.DONE)))
    assert not finishing(_observed({0: Phase.DONE, 1: Phase.DONE, 2: Phase.DONE,
                                    3: Phase.COMPUTE}))
    assert not finishing(_observed({0: Phase.DONE, 1: Phase.DONE, 2: Phase.DONE}))  # 3 unheard


def test_the_watcher_polls_briefly_faster_while_the_ranks_exit() -> None:
    """The last segment completes when every agent reports its ranks exited; at the
    policy's poll interval that was seen up to a whole interval late."""
    assert next_pause(0.5, None, 100.0) == 0.5  # training: the policy's interval
    assert next_pause(0.5, 100.0, 100.2) == FINISHING_POLL_SECONDS < 0.5
    assert next_pause(0.05, 100.0, 100.2) == 0.05  # never slower than the policy's
    # a rank stuck on its way out: back to the policy's interval (its hang rule decides)
    assert next_pause(0.5, 100.0, 100.0 + FINISHING_FOR_SECONDS) == 0.5


def test_the_watcher_looks_again_when_a_threshold_falls_due() -> None:
    """Not up to a poll interval later: sooner, just past the threshold."""
    assert next_pause(0.5, None, 100.0, due_in=0.2) == pytest.approx(0.2 + DUE_MARGIN_SECONDS)
    assert next_pause(0.5, None, 100.0, due_in=3.0) == 0.5  # no later than the policy's
    assert next_pause(0.5, None, 100.0, due_in=-1.0) == DUE_MIN_PAUSE_SECONDS  # never spins
    assert next_pause(0.5, 100.0, 100.2, due_in=0.3) == FINISHING_POLL_SECONDS


def test_run_looks_again_when_silent_ranks_reach_heartbeat_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks' last beats are 1 s old and the policy looks every 5 s: the watcher looks
    again when they reach heartbeat_timeout (2 s), not 5 s later."""
    root = fabricate(
        tmp_path / "try-1",
        {"node-a": (NodeState.RUNNING, {0: None, 1: None}),
         "node-b": (NodeState.RUNNING, {2: None, 3: None})},
    )
    write_training_heartbeats(root, step=40, age=1.0)
    pauses: list[float] = []
    pause = triggers.next_pause
    monkeypatch.setattr(triggers, "next_pause",
                        lambda *args: pauses.append(pause(*args)) or pauses[-1])
    trigger = SegmentWatchTrigger(str(root), NODE_RANKS, poll_interval_seconds=5.0)

    event = asyncio.run(first_event(trigger))

    assert event.payload["fault"]["kind"] == "rank_unresponsive"
    assert pauses and max(pauses) < 2.0  # not the policy's 5 s


def test_run_polls_faster_once_every_rank_reported_its_loop_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = fabricate(
        tmp_path / "try-1",
        {"node-a": (NodeState.RUNNING, {0: None, 1: None}),
         "node-b": (NodeState.RUNNING, {2: None, 3: None})},
    )
    write_training_heartbeats(root, step=40)
    for beat_file in (root / "heartbeats").iterdir():  # every loop ended, no rank exited yet
        beat = Heartbeat.from_json(beat_file.read_text())
        beat.phase = Phase.DONE.value
        write_atomically(beat_file, beat.to_json())
    pauses: list[float] = []
    pause = triggers.next_pause
    monkeypatch.setattr(triggers, "next_pause",
                        lambda *args: pauses.append(pause(*args)) or pauses[-1])
    trigger = SegmentWatchTrigger(str(root), NODE_RANKS, poll_interval_seconds=0.5)

    async def scenario() -> TriggerEvent:
        task = asyncio.create_task(first_event(trigger))
        await asyncio.sleep(0.3)
        write_records(root, {"node-a": (NodeState.SUCCEEDED, {0: 0, 1: 0}),
                             "node-b": (NodeState.SUCCEEDED, {2: 0, 3: 0})})
        return await task

    event = asyncio.run(scenario())

    assert event.payload["status"] == "completed"
    assert pauses and set(pauses) == {FINISHING_POLL_SECONDS}


def test_the_event_airflow_logs_at_info_says_what_happened_not_the_launch_record() -> None:
    """Airflow's triggerer logs each event by its repr into the task's log; it still travels
    whole, through the triggerer's own messages, to execute_complete."""
    from airflow.jobs.triggerer_job_runner import TriggerEventEntry, messages

    from relay.core.faults import Fault, FaultKind
    from relay.watch.triggers import WatchEvent

    fault = Fault(FaultKind.HANG, 1, "node-a", {"summary": "stalled"}, 100.0)
    record = {"launch": {"attempt_dir": "/x", "nodes": ["node-a"] * 50}, "handle": {"k": "v"}}
    event = WatchEvent({**fault.to_event(), "attempt_dir": "/x", "launch_record": record})

    assert repr(event) == "WatchEvent<faulted: hang (node node-a, rank 1)>"
    assert repr(WatchEvent({"status": "completed", "launch_record": record})) == \
        "WatchEvent<completed>"
    sent = messages.TriggerStateChanges(events=[TriggerEventEntry(7, event, None)])
    back = messages.TriggerStateChanges.model_validate_json(sent.model_dump_json())
    assert back.events is not None and back.events[0].event.payload == event.payload
