"""Standby agents on a real 4-rank workload: taken ones train, untaken ones go away."""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from processes import workload_processes

from relay.launchers.local import warm_start
from relay.launchers.local.launcher import LocalLauncher, group_members
from relay.policy.model import Detection
from relay.tools.bench.common import Store, launch_config, watch
from relay_train.agent.standby import ready_file, standby_file

pytestmark = pytest.mark.integration


def _train_on_standbys(launcher: LocalLauncher, store: Store, folder: Path) -> Path:
    """Launch 20 steps on the standbys of the segment's standby folder (the launcher looks
    there), watch them complete, stop; return the attempt folder."""
    cfg = launch_config(store, folder, steps=20)
    attempt = launcher.launch(cfg)
    try:
        # What is tested is the launch, not the detector's thresholds on a busy machine:
        # a generous hang timeout still ends a workload that is stuck for good.
        event = watch(cfg, Detection(hang_timeout=30.0), timeout=180)
    finally:
        launcher.stop(attempt, grace_seconds=2.0)
    assert event["status"] == "completed", (event, _stacks(attempt.folder))
    return attempt.folder


def _stacks(root: Path) -> str:
    """The ranks' stacks that the watcher collected for a fault (to say where they were)."""
    return "\n".join(f"{path.name}:\n{path.read_text()[-3000:]}"
                     for path in sorted((root / "evidence").glob("faulthandler-rank-*.txt")))


def _wait_all_gone(tmp_path: Path, pid: int) -> None:
    """Wait until ``pid``'s group and every workload process under ``tmp_path`` are gone."""
    deadline = time.monotonic() + 30
    while group_members(pid) or workload_processes(tmp_path):
        assert time.monotonic() < deadline, workload_processes(tmp_path)
        time.sleep(0.1)


def test_a_launch_takes_the_preloaded_standbys_and_stops_the_rest(tmp_path: Path) -> None:
    store = Store(tmp_path / "mlflow")
    standby = tmp_path / "segment" / "standby"
    launcher = LocalLauncher()
    launcher.warm_standbys(standby, ["node-a", "node-b", "node-c"])
    pids = {n: json.loads(standby_file(standby, n).read_text())["pid"]
            for n in ("node-a", "node-b", "node-c")}
    deadline = time.monotonic() + 120
    while not all(ready_file(standby, n).exists() for n in pids):
        assert time.monotonic() < deadline, "standbys never became ready"
        time.sleep(0.1)
    root = _train_on_standbys(launcher, store, tmp_path / "segment" / "try-1")
    for node in ("node-a", "node-b"):
        agent_log = (root / "logs" / f"agent-{node}.log").read_text()
        assert "took over" in agent_log, agent_log
        assert "preloaded the training stack" not in agent_log  # no second preload
    handle = json.loads((root / "handle.json").read_text())["nodes"]
    assert handle["node-a"]["pid"] == pids["node-a"]
    # node-c was not in the launch: its standby was stopped, and nothing is left behind.
    _wait_all_gone(tmp_path, pids["node-c"])
    assert list(standby.glob("*.standby")) == []


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_launch_without_standbys_gets_them_forked_by_the_runs_resident(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What preflight sets up for the first segment: the run's resident agent preloads,
    and the launch asks it for each node's standby (waiting while it preloads) instead
    of starting agents that import the training stack again, one per node."""
    from relay.launchers.local import warm_agents
    from relay.launchers.local.warm_agents import release_run
    from relay_train.agent.resident import RESIDENT_DIR, ask_standby

    # What is tested is who forks the standbys, not how fast a loaded machine does: the
    # bound on a ready resident's answer (1 s, then an agent the slow way) is widened.
    monkeypatch.setattr(warm_agents, "ask_standby", functools.partial(ask_standby,
                                                                      wait_seconds=60.0))

    store = Store(tmp_path / "mlflow")
    launcher = LocalLauncher()
    launcher.reside(tmp_path, ["node-a"])  # the run's folder: segment/standby's grandparent
    resident_pid = json.loads(standby_file(tmp_path / RESIDENT_DIR, "node-a").read_text())["pid"]
    try:
        root = _train_on_standbys(launcher, store, tmp_path / "segment" / "try-1")
        handle = json.loads((root / "handle.json").read_text())["nodes"]
        resident_log = (tmp_path / RESIDENT_DIR / "node-a.log").read_text()
        for node in ("node-a", "node-b"):
            assert handle[node].get("standby"), handle
            forked = f"forked a standby for {node}, pid {handle[node]['pid']},"
            assert forked in resident_log, resident_log
            agent_log = (root / "logs" / f"agent-{node}.log").read_text()
            assert "took over" in agent_log, agent_log
    finally:
        release_run(tmp_path)
    _wait_all_gone(tmp_path, resident_pid)


@pytest.mark.slow
def test_the_agents_of_a_stopped_attempt_hand_on_preloaded_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A retry's standby on a node the faulty attempt used is forked from that node's agent:
    it survives the attempt's stop and takes the next launch without preloading again."""
    # What is tested is where the copies come from, not how fast a loaded machine forks:
    # the launcher's bound on an agent's answer (1.5 s, then a standby the slow way) is
    # widened so that a busy CI machine cannot turn a copy into a new process.
    monkeypatch.setattr(warm_start, "STANDBY_ASK_TIMEOUT_SECONDS", 60.0)
    store = Store(tmp_path / "mlflow")
    standby = tmp_path / "segment" / "standby"
    launcher = LocalLauncher()
    first = launch_config(store, tmp_path / "segment" / "try-1", steps=10**6)
    attempt = launcher.launch(first)
    root = attempt.folder
    try:
        deadline = time.monotonic() + 120
        while not (root / "first_step.json").exists():  # the agents run and answer
            assert time.monotonic() < deadline, "the first attempt never stepped"
            time.sleep(0.1)
        agents = {n: h["pid"] for n, h in launcher.handle(attempt)["nodes"].items()}
        launcher.warm_standbys(standby, ["node-a", "node-b", "node-c"], source=attempt)
        pids = {n: json.loads(standby_file(standby, n).read_text())["pid"]
                for n in ("node-a", "node-b", "node-c")}
        for node in ("node-a", "node-b"):  # copies of the attempt's agents...
            assert _parent(pids[node]) == agents[node]
            assert group_members(pids[node]) and pids[node] not in group_members(agents[node])
        assert _parent(pids["node-c"]) != agents.get("node-c")  # ...a node it lacked: new
    finally:
        assert launcher.stop(attempt, grace_seconds=2.0) == []
    assert all(group_members(pids[n]) for n in ("node-a", "node-b")), "the stop took them"
    root = _train_on_standbys(launcher, store, tmp_path / "segment" / "try-2")
    handle = json.loads((root / "handle.json").read_text())["nodes"]
    for node in ("node-a", "node-b"):
        assert handle[node]["pid"] == pids[node]
        agent_log = (root / "logs" / f"agent-{node}.log").read_text()
        assert "took over" in agent_log, agent_log
    _wait_all_gone(tmp_path, pids["node-c"])


def _watch_with_spare(tmp_path: Path, chaos: list[dict[str, Any]],
                      freeze: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Watch an endless 4-rank launch with a spare planned on node-c; inject ``chaos`` (or,
    3 s into the watch, freeze the node ``freeze``). Return the first event and the spare's
    standby record."""
    from concurrent.futures import ThreadPoolExecutor

    from relay.launchers.local import spare
    from relay.tools.bench.common import _first_event, node_ranks
    from relay.watch.triggers import SegmentWatchTrigger

    store = Store(tmp_path / "mlflow")
    standby = tmp_path / "segment" / "standby"
    launcher = LocalLauncher()
    cfg = launch_config(store, tmp_path / "segment" / "try-1", steps=10**6, chaos=chaos)
    attempt = launcher.launch(cfg)
    root = attempt.folder
    detection = Detection()
    trigger = SegmentWatchTrigger(
        attempt_dir=cfg.attempt_dir, node_ranks=node_ranks(cfg),
        detection=detection.model_dump(), heartbeat_interval_seconds=cfg.heartbeat_interval_seconds,
        poll_interval_seconds=detection.poll_interval,
        spare=spare.plan(standby, ["node-c"], 60.0))
    try:
        deadline = time.monotonic() + 120
        while not (root / "first_step.json").exists():
            assert time.monotonic() < deadline, "the attempt never stepped"
            time.sleep(0.1)
        with ThreadPoolExecutor(1) as pool:
            watching = pool.submit(asyncio.run, _first_event(trigger, 120))
            if freeze is not None:  # the watcher hears both nodes, then one freezes
                time.sleep(3)
                assert not watching.done(), watching.result()
                launcher.signal_node(attempt, freeze, signal.SIGSTOP)
            event = watching.result()
    finally:
        if freeze is not None:
            launcher.signal_node(attempt, freeze, signal.SIGCONT)
        launcher.stop(attempt, grace_seconds=2.0)
    record = json.loads(standby_file(standby, "node-c").read_text())
    assert list(standby.glob("node-[ab].standby")) == []  # only the spare
    LocalLauncher.release_standbys(standby)
    _wait_all_gone(tmp_path, record["pid"])
    return event, record


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "chaos", "freeze"), [
    ("node_unresponsive", [], "node-b"),
    ("hang", [{"kind": "hang", "step": 40, "rank": 1}], None),
    ("straggler", [{"kind": "straggler", "step": 60, "rank": 2, "factor": 3.0}], None),
], ids=["frozen-node", "hang", "straggler"])
def test_the_watcher_warms_a_spare_before_it_calls_the_fault(
        tmp_path: Path, kind: str, chaos: list[dict[str, Any]], freeze: str | None) -> None:
    """The standby of the node a retry takes starts preloading at the first sign of a fault
    (a missed poll; a rank in compute past half the hang threshold while others wait; a rank
    over the straggler ratio for two steps), before the fault is called."""
    event, record = _watch_with_spare(tmp_path, chaos, freeze)
    assert event["fault"]["kind"] == kind, event
    assert record["started_at"] < event["fault"]["detected_at"], (record, event["fault"])
