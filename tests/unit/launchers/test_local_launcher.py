"""Unit tests for LocalLauncher.stop / stop_all / status on a fake workload (no training)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from agents import FrozenAgent, close_served_agents, serve  # noqa: F401 - the fixture closes them

from relay.core.attempt import Attempt, AttemptState
from relay.launchers.local.launcher import (
    HANDLE_FILE,
    LaunchStatus,
    LocalLauncher,
    NodeStatus,
    agent_handle,
    group_members,
)
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.launch import LAUNCH_FILE, STOP_FILE, LaunchConfig, attempt_id_of
from relay_train.protocol.routes import NodeState

SLEEP_WITH_CHILD = "sleep 60 & sleep 60"
IGNORES_TERM = 'trap "" TERM; sleep 60'


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def proc_state(pid: int) -> str | None:
    """Return the one-letter state of ``pid`` from /proc, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def live(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z")


class Workload:
    """Fake node agents: process groups started like LocalLauncher.launch starts them."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.members: dict[int, list[int]] = {}

    def agent(self, script: str, min_members: int = 1) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            ["bash", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append(proc)
        assert wait_for(lambda: len(group_members(proc.pid)) >= min_members), (
            f"group {proc.pid} never reached {min_members} members"
        )
        if script == IGNORES_TERM:
            # Only count the group as ready once the trap is in place.
            assert wait_for(lambda: _ignores_term(proc.pid))
        self.members[proc.pid] = group_members(proc.pid)
        return proc

    def attempt(self, root: Path, nodes: dict[str, subprocess.Popen[bytes]]) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        handle = {n: agent_handle(p.pid) for n, p in nodes.items()}
        (root / HANDLE_FILE).write_text(json.dumps({"nodes": handle, "started_at": time.time()}))
        return root

    def all_pids(self) -> list[int]:
        return [pid for pids in self.members.values() for pid in pids]

    def cleanup(self) -> None:
        # Signal a group only while its PGID is certainly still ours: its leader is
        # unreaped, or some member still carries the PGID (so it cannot be reused).
        for proc in self.procs:
            if proc.returncode is not None and not group_members(proc.pid):
                continue
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.wait(timeout=10)


def _ignores_term(pid: int) -> bool:
    members = group_members(pid)
    if not members:
        return False
    for member in members:
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            return False
        ignored = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
        if not int(ignored.split()[1], 16) & (1 << (signal.SIGTERM - 1)):
            return False
    return True


@pytest.fixture
def workload() -> Iterator[Workload]:
    fake = Workload()
    try:
        yield fake
    finally:
        fake.cleanup()


@pytest.fixture
def launcher() -> LocalLauncher:
    return LocalLauncher()


def assert_all_gone(workload: Workload) -> None:
    for pgid in workload.members:
        assert group_members(pgid) == [], f"group {pgid} still has members"
    survivors = [pid for pid in workload.all_pids() if live(pid)]
    assert survivors == []


def test_stop_kills_every_member_of_every_group(
    tmp_path: Path, workload: Workload, launcher: LocalLauncher
) -> None:
    nodes = {
        "node-a": workload.agent(SLEEP_WITH_CHILD, min_members=2),
        "node-b": workload.agent(SLEEP_WITH_CHILD, min_members=2),
    }
    root = workload.attempt(tmp_path / "try-1", nodes)
    assert len(workload.all_pids()) >= 4

    assert launcher.stop(Attempt(root), grace_seconds=5) == []

    assert_all_gone(workload)
    for proc in nodes.values():
        assert proc.wait(timeout=5) == -signal.SIGTERM


def test_stop_kills_a_stopped_group(
    tmp_path: Path, workload: Workload, launcher: LocalLauncher
) -> None:
    stopped = workload.agent(SLEEP_WITH_CHILD, min_members=2)
    running = workload.agent("sleep 60")
    os.killpg(stopped.pid, signal.SIGSTOP)
    assert wait_for(lambda: all(proc_state(p) == "T" for p in workload.members[stopped.pid]))
    root = workload.attempt(tmp_path / "try-1", {"node-a": stopped, "node-b": running})

    assert launcher.stop(Attempt(root), grace_seconds=5) == []

    assert_all_gone(workload)
    # It died of the SIGTERM it saw once continued, not of a SIGKILL after the grace.
    assert stopped.wait(timeout=5) == -signal.SIGTERM


def test_stop_marks_its_sigterm_as_relays_before_sending_it(
    tmp_path: Path, workload: Workload, launcher: LocalLauncher
) -> None:
    # An agent the channel's ask cannot reach (here: no port at all, as a frozen or loaded
    # agent's ask that times out) must still read the SIGTERM as Relay's stop, not as a
    # preemption notice (relay_train.agent.notice): it finds the mark when the signal comes.
    root = tmp_path / "try-1"
    mark = root / STOP_FILE
    agent = workload.agent(f"trap 'if [ -e {mark} ]; then exit 0; else exit 75; fi' TERM; "
                           "sleep 60 & wait", min_members=2)
    workload.attempt(root, {"node-a": agent})
    assert not mark.exists()

    assert launcher.stop(Attempt(root), grace_seconds=5) == []

    assert agent.wait(timeout=5) == 0  # 75: it saw no mark, a notice


def test_stop_sigkills_a_group_that_ignores_sigterm(
    tmp_path: Path, workload: Workload, launcher: LocalLauncher
) -> None:
    stubborn = workload.agent(IGNORES_TERM)
    polite = workload.agent("sleep 60")
    root = workload.attempt(tmp_path / "try-1", {"node-a": stubborn, "node-b": polite})

    assert launcher.stop(Attempt(root), grace_seconds=0.5) == []

    assert_all_gone(workload)
    assert stubborn.wait(timeout=5) == -signal.SIGKILL
    assert polite.wait(timeout=5) == -signal.SIGTERM


def test_stop_kills_ranks_that_outlived_their_agent(
    tmp_path: Path, workload: Workload, launcher: LocalLauncher
) -> None:
    agent = workload.agent(SLEEP_WITH_CHILD, min_members=2)
    os.kill(agent.pid, signal.SIGKILL)  # the agent dies, its group lives on
    agent.wait(timeout=5)
    orphans = [p for p in workload.members[agent.pid] if p != agent.pid]
    assert orphans and all(live(p) for p in orphans)
    root = workload.attempt(tmp_path / "try-1", {"node-a": agent})

    assert launcher.stop(Attempt(root), grace_seconds=5) == []

    assert_all_gone(workload)


def test_stop_with_nothing_left_is_a_no_op(
    tmp_path: Path, workload: Workload, launcher: LocalLauncher
) -> None:
    done = workload.agent("sleep 60")
    done.kill()
    done.wait(timeout=5)
    root = workload.attempt(tmp_path / "try-1", {"node-a": done})

    assert launcher.stop(Attempt(root)) == []
    assert launcher.stop(Attempt(tmp_path / "never-launched")) == []


def test_stop_all_stops_every_attempt_of_the_segment(
    tmp_path: Path, workload: Workload, launcher: LocalLauncher
) -> None:
    segment = tmp_path / "segment-001"
    workload.attempt(segment / "try-1", {"node-a": workload.agent(SLEEP_WITH_CHILD, 2)})
    workload.attempt(
        segment / "try-2",
        {"node-a": workload.agent("sleep 60"), "node-b": workload.agent(SLEEP_WITH_CHILD, 2)},
    )
    (segment / "try-3").mkdir()  # never got a handle: nothing to stop, not an error
    (segment / "notes.txt").write_text("not an attempt")

    assert launcher.stop_all(segment) == []

    assert_all_gone(workload)


def test_stop_all_of_a_missing_segment_is_empty(tmp_path: Path, launcher: LocalLauncher) -> None:
    assert launcher.stop_all(tmp_path / "segment-009") == []


# --- status -----------------------------------------------------------------------------


def dead_pid() -> int:
    """Return the PID of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=10)
    assert not live(proc.pid)
    return proc.pid


def fabricate(root: Path, agents: dict[str, int], records: dict[str, dict | None]) -> Path:
    """Write handle.json for ``agents`` (node -> pid); serve ``records`` over the channel.

    A node whose record is None has no channel server (its agent never answered).
    """
    root.mkdir(parents=True, exist_ok=True)
    LaunchConfig(  # where the launcher's channel finds the attempt's secret
        job="t", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=10,
        checkpoint_every=5, nodes=list(agents), ranks_per_node=1, tracking_uri="", run_id="r",
        attempt_dir=str(root), attempt=1, segment=0, channel_secret=new_secret(),
    ).write(root / LAUNCH_FILE)
    answering = {n: r for n, r in records.items() if r is not None}
    served = serve(root, {n: [int(k) for k in r["exit_codes"]] for n, r in answering.items()})
    for node, record in answering.items():
        served.nodes[node].state = record["state"]
        served.nodes[node].exit_codes = {int(k): c for k, c in record["exit_codes"].items()}
    handle = {n: {**agent_handle(pid), "port": int(served.addresses[n].rsplit(":", 1)[1])
                  if n in answering else None} for n, pid in agents.items()}
    (root / HANDLE_FILE).write_text(json.dumps({"nodes": handle, "started_at": time.time(),
                                                "attempt_id": attempt_id_of(root)}))
    return root


def record(node: str, state: NodeState, exit_codes: dict[int, int | None]) -> dict:
    return {
        "node": node,
        "state": state,
        "agent_pid": 1,
        "pgid": 1,
        "rank_pids": {str(r): 1000 + r for r in exit_codes},
        "exit_codes": {str(r): c for r, c in exit_codes.items()},
        "wall_clock": 1700000000.0,
    }


def test_status_running(tmp_path: Path, launcher: LocalLauncher) -> None:
    me = os.getpid()
    root = fabricate(
        tmp_path,
        {"n0": me, "n1": me},
        {
            "n0": record("n0", NodeState.RUNNING, {0: None, 1: None}),
            "n1": record("n1", NodeState.RUNNING, {2: None, 3: None}),
        },
    )

    status = launcher.status(Attempt(root))

    assert status.state is AttemptState.RUNNING
    assert set(status.nodes) == {"n0", "n1"}
    assert status.nodes["n0"].state == NodeState.RUNNING
    assert status.nodes["n0"].exit_codes == {0: None, 1: None}
    assert status.nodes["n0"].last_seen == pytest.approx(time.time(), abs=5)  # Relay's clock
    assert status.failed_ranks() == {}


def test_status_running_while_one_node_is_still_starting(
    tmp_path: Path, launcher: LocalLauncher
) -> None:
    me = os.getpid()
    root = fabricate(
        tmp_path, {"n0": me, "n1": me},
        {"n0": record("n0", NodeState.SUCCEEDED, {0: 0}), "n1": None},
    )

    status = launcher.status(Attempt(root))

    assert status.state is AttemptState.RUNNING
    assert status.nodes["n1"].state == NodeState.STARTING


def test_status_succeeded(tmp_path: Path, launcher: LocalLauncher) -> None:
    gone = dead_pid()  # agents that finished are gone: their final record is what counts
    root = fabricate(
        tmp_path,
        {"n0": gone, "n1": gone},
        {
            "n0": record("n0", NodeState.SUCCEEDED, {0: 0, 1: 0}),
            "n1": record("n1", NodeState.SUCCEEDED, {2: 0, 3: 0}),
        },
    )

    status = launcher.status(Attempt(root))

    assert status.state is AttemptState.COMPLETED
    assert status.failed_ranks() == {}


def test_status_failed_with_exit_codes(tmp_path: Path, launcher: LocalLauncher) -> None:
    me = os.getpid()
    root = fabricate(
        tmp_path,
        {"n0": me, "n1": me},
        {
            "n0": record("n0", NodeState.RUNNING, {0: None, 1: None}),
            "n1": record("n1", NodeState.FAILED, {2: -9, 3: -15}),
        },
    )

    status = launcher.status(Attempt(root))

    assert status.state is AttemptState.FAILED
    assert status.nodes["n1"].state == NodeState.FAILED
    assert status.nodes["n1"].exit_codes == {2: -9, 3: -15}
    assert status.failed_ranks() == {2: -9, 3: -15}


@pytest.mark.parametrize("last_said", [NodeState.STARTING, NodeState.RUNNING])
def test_status_agent_died_without_a_final_status(
    tmp_path: Path, launcher: LocalLauncher, last_said: NodeState
) -> None:
    root = fabricate(
        tmp_path,
        {"n0": os.getpid(), "n1": dead_pid()},
        {
            "n0": record("n0", NodeState.RUNNING, {0: None}),
            "n1": record("n1", last_said, {1: None}),
        },
    )

    status = launcher.status(Attempt(root))

    assert status.state is AttemptState.FAILED
    assert status.nodes["n0"].state == NodeState.RUNNING
    assert status.nodes["n1"].state == NodeState.FAILED
    assert "agent died without a final status" in status.nodes["n1"].detail


def test_status_agent_exited_before_reporting(tmp_path: Path, launcher: LocalLauncher) -> None:
    root = fabricate(tmp_path, {"n0": dead_pid()}, {"n0": None})

    status = launcher.status(Attempt(root))

    assert status.state is AttemptState.FAILED
    assert status.nodes["n0"].state == NodeState.FAILED
    assert "before reporting" in status.nodes["n0"].detail


def test_status_zombie_agent_counts_as_dead(
    tmp_path: Path, workload: Workload, launcher: LocalLauncher
) -> None:
    agent = workload.agent("sleep 60")
    agent.send_signal(signal.SIGKILL)
    assert wait_for(lambda: proc_state(agent.pid) == "Z")  # exited, not yet reaped
    root = fabricate(tmp_path, {"n0": agent.pid},
                     {"n0": record("n0", NodeState.RUNNING, {0: None})})

    assert launcher.status(Attempt(root)).state is AttemptState.FAILED


def test_status_without_handle_is_failed_with_no_nodes(
    tmp_path: Path, launcher: LocalLauncher
) -> None:
    status = launcher.status(Attempt(tmp_path))

    assert status == LaunchStatus(AttemptState.FAILED, {})


def test_failed_ranks_ignores_running_and_clean_exits() -> None:
    status = LaunchStatus(
        AttemptState.FAILED,
        {
            "n0": NodeStatus("n0", NodeState.FAILED, {0: 0, 1: None, 2: 1}),
            "n1": NodeStatus("n1", NodeState.FAILED, {3: -9}),
        },
    )

    assert status.failed_ranks() == {2: 1, 3: -9}


# --- an agent that cannot be asked to stop ------------------------------------------------

# As a node agent does: a SIGTERM nobody asked for over the channel is a preemption notice
# (its ranks, here the child, still die of it). The child starts before the trap is set.
AGENT_TAKING_TERM_AS_NOTICE = 'sleep 60 & trap "" TERM; while :; do sleep 1; done'


def launch_file(root: Path) -> Path:
    """Write the launch file of a one-node attempt at ``root`` (its channel secret)."""
    root.mkdir(parents=True, exist_ok=True)
    LaunchConfig(
        job="t", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=10,
        checkpoint_every=5, nodes=["node-a"], ranks_per_node=1, tracking_uri="", run_id="r",
        attempt_dir=str(root), attempt=1, segment=0, channel_secret=new_secret(),
    ).write(root / LAUNCH_FILE)
    return root


def on_channel(root: Path, agent: subprocess.Popen[bytes], address: str) -> Path:
    """Write the handle of the attempt's one node ``agent``, its channel at ``address``."""
    handle = {"node-a": {**agent_handle(agent.pid), "port": int(address.rsplit(":", 1)[1])}}
    (root / HANDLE_FILE).write_text(json.dumps({"nodes": handle, "started_at": time.time(),
                                                "attempt_id": attempt_id_of(root)}))
    return root


def term_ignored(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(ignored.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def test_stop_sigkills_at_once_an_agent_that_did_not_answer_the_stop(
    tmp_path: Path, workload: Workload, launcher: LocalLauncher,
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = workload.agent(AGENT_TAKING_TERM_AS_NOTICE, min_members=2)
    assert wait_for(lambda: term_ignored(agent.pid))
    frozen = FrozenAgent()  # its channel takes the connection and never answers
    try:
        root = on_channel(launch_file(tmp_path / "try-1"), agent, frozen.address)
        with caplog.at_level("INFO", logger="relay.launchers.local.launcher"):
            assert launcher.stop(Attempt(root), grace_seconds=5) == []
    finally:
        frozen.close()

    assert_all_gone(workload)
    assert agent.wait(timeout=5) == -signal.SIGKILL
    # Killed because it could not be asked, not after the grace for ignoring SIGTERM.
    assert "did not answer the stop" in caplog.text
    assert "ignored SIGTERM" not in caplog.text


def test_stop_leaves_an_agent_that_answered_the_stop_to_sigterm(
    tmp_path: Path, workload: Workload, launcher: LocalLauncher,
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = workload.agent(SLEEP_WITH_CHILD, min_members=2)
    root = launch_file(tmp_path / "try-1")
    served = serve(root, {"node-a": [0]})  # a channel that answers, as a live agent's
    on_channel(root, agent, served.addresses["node-a"])

    with caplog.at_level("INFO", logger="relay.launchers.local.launcher"):
        assert launcher.stop(Attempt(root), grace_seconds=5) == []

    assert_all_gone(workload)
    assert agent.wait(timeout=5) == -signal.SIGTERM
    assert "did not answer the stop" not in caplog.text
