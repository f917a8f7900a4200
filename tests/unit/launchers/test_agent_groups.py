"""Aggregators: one signed summary per group of nodes, and what a silent one reads as.

The agents are real :class:`relay_train.agent.server.AgentServer`s over a folder the test
writes (``tests/agents.py``), the aggregators real :class:`relay.launchers.aggregator.
Aggregator`s served by the same server class; each test drives an aggregator's round by
hand (``aggregator.channel.poll()``), so nothing waits on its loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agents import FrozenAgent, ServedAttempt

import relay.launchers.agent_groups as groups_module
from relay.core.attempt import Attempt
from relay.core.faults import FaultKind
from relay.launchers.agent_client import AgentChannel, place_on_our_clock
from relay.launchers.agent_groups import (
    Group,
    GroupWatch,
    decode_node,
    encode_summary,
    fresh,
    groups_of,
)
from relay.launchers.agent_requests import parse_answer
from relay.launchers.aggregator import Aggregator
from relay.policy.model import Detection
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay_train.agent.server import AgentServer
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.heartbeat import HeartbeatWriter, Phase
from relay_train.protocol.launch import attempt_id_of
from relay_train.protocol.routes import (
    AGE_SECONDS,
    HEARTBEATS,
    NODES,
    PHASE_AGE_SECONDS,
    SEEN_AGE_SECONDS,
    STATE,
    NodeState,
    Route,
)

NODES_OF = {"node-a": [0, 1], "node-b": [2, 3], "node-c": [4, 5], "node-d": [6, 7]}
GROUPS = {"aggregator-0": ("node-a", "node-b"), "aggregator-1": ("node-c", "node-d")}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    attempt = tmp_path / "relay_t" / "run-1" / "segment-000" / "try-1"
    (attempt / "heartbeats").mkdir(parents=True)
    for node, ranks in NODES_OF.items():
        for rank in ranks:
            writer = HeartbeatWriter(attempt / "heartbeats", rank, node, 1.0, step=7)
            writer.enter(Phase.COMPUTE)
            writer.beat(step=7, compute_seconds=0.05, samples_per_second=100.0, loss=2.0)
            writer.flush_now()
    return attempt


class Tree:
    """Real agents, real aggregators in front of them, and the watcher's channel."""

    def __init__(self, root: Path, secret: str | None = None) -> None:
        self.agents = ServedAttempt(root, NODES_OF)
        self.attempt_id = attempt_id_of(root)
        self.aggregators: dict[str, Aggregator] = {}
        self.servers: dict[str, AgentServer] = {}
        for name, nodes in GROUPS.items():
            agg = Aggregator(self.attempt_id, name, {n: self.agents.addresses[n] for n in nodes},
                             self.agents.secret)
            self.aggregators[name] = agg
            self.servers[name] = AgentServer(agg, "127.0.0.1", 0,
                                             secret=secret or self.agents.secret).start()
        self.groups = [Group(name, "http://{}:{}".format(*self.servers[name].address), nodes)
                       for name, nodes in GROUPS.items()]
        self.channel = AgentChannel(self.attempt_id, self.agents.addresses, self.agents.secret,
                                    groups=self.groups)
        self.asked_directly: list[str] = []
        real = self.channel._status
        self.channel._status = lambda node: (self.asked_directly.append(node), real(node))[1]  # type: ignore[method-assign]

    def round(self) -> None:
        """Let every aggregator ask its group once."""
        for agg in self.aggregators.values():
            agg.channel.poll()

    def close(self) -> None:
        self.channel.close()
        for agg in self.aggregators.values():
            agg.channel.close()
        for server in self.servers.values():
            server.close()
        self.agents.close()


@pytest.fixture
def tree(root: Path) -> Iterator[Tree]:
    made = Tree(root)
    yield made
    made.close()


def test_up_to_32_nodes_are_asked_directly_above_in_groups_of_32() -> None:
    assert groups_of([f"n{i}" for i in range(32)]) == []
    cut = groups_of([f"n{i}" for i in range(70)])
    assert [len(g) for g in cut] == [32, 32, 6]
    assert sum(cut, []) == [f"n{i}" for i in range(70)]


def test_a_summary_places_each_heartbeat_where_a_direct_answer_would() -> None:
    record = {"rank": 3, "node": "n", "pid": 11, "pid_started": 5, "step": 9, "phase": "compute",
              "compute_seconds": 0.05, "compute_total": 0.4, "samples_per_second": 80.0,
              "loss": 1.5, "nonfinite_step": None, "seq": 4, "wall_clock": 0.0,
              "phase_started_at": 0.0, AGE_SECONDS: 0.3, PHASE_AGE_SECONDS: 0.7}
    summary = encode_summary({"n": (100.0, {STATE: "running", HEARTBEATS: [record]})}, 100.5)
    assert summary[NODES]["n"][SEEN_AGE_SECONDS] == 0.5
    heard_at, status, beats, _ = decode_node("n", summary[NODES]["n"], 1000.0)
    assert heard_at == 999.5 and status[STATE] == "running"
    direct = place_on_our_clock(record, 999.5)  # what asking the agent at 999.5 gives
    assert beats[3] == direct
    assert beats[3].wall_clock == pytest.approx(999.2)
    assert beats[3].phase_started_at == pytest.approx(998.8)


def test_a_summary_is_fresh_only_while_some_node_was_heard_lately() -> None:
    assert not fresh({})
    assert not fresh({NODES: {}})
    stale = {SEEN_AGE_SECONDS: groups_module.STALE_SUMMARY_SECONDS + 4}
    assert not fresh({NODES: {"a": stale, "b": stale}})
    assert fresh({NODES: {"a": stale, "b": {SEEN_AGE_SECONDS: 0.1}}})


def test_an_aggregator_is_down_once_silent_while_others_answer_and_up_when_it_answers() -> None:
    watch = GroupWatch([Group("g", "http://x", ("a", "b")), Group("h", "http://y", ("c",))],
                       now=100.0)
    later = 100.1 + groups_module.DOWN_AFTER_SECONDS
    assert watch.direct_nodes(later) == set()  # both late: the watcher's host, maybe
    watch.answered("h", later)  # h answers, g does not: g is down
    assert watch.direct_nodes(later) == {"a", "b"}
    watch.answered("g", later + 0.1)
    assert watch.direct_nodes(later + 0.1) == set()


def test_every_aggregator_is_down_once_all_are_silent_for_long() -> None:
    watch = GroupWatch([Group("g", "http://x", ("a",)), Group("h", "http://y", ("c",))],
                       now=100.0)
    assert watch.direct_nodes(100.0 + groups_module.ALL_DOWN_AFTER_SECONDS) == set()
    assert watch.direct_nodes(100.1 + groups_module.ALL_DOWN_AFTER_SECONDS) == {"a", "c"}


def test_the_watcher_reads_every_node_through_its_aggregator_and_asks_none(tree: Tree) -> None:
    tree.round()
    tree.channel.poll()
    assert tree.asked_directly == []
    assert sorted(tree.channel.reports) == sorted(NODES_OF)
    assert sorted(tree.channel.beats) == list(range(8))
    now = time.time()
    assert all(now - b.wall_clock < 5 and b.step == 7 for b in tree.channel.beats.values())


def test_a_node_agent_serves_no_summary(tree: Tree) -> None:
    assert tree.channel.call("node-a", Route.SUMMARY) is None  # 404: not an aggregator


def _silent_since_long(channel: AgentChannel) -> None:
    """Make every aggregator's last fresh summary 30 s old (down unless it answers now)."""
    for name in channel.groups.heard:
        channel.groups.heard[name] -= 30.0


def _detect(agents: ServedAttempt) -> FaultKind | None:
    status = agents.status(Attempt(agents.root))  # the launcher's view over this channel
    obs = Observation(now=time.time(), launched_at=time.time() - 60, heartbeats=status.heartbeats,
                      node_ranks=NODES_OF, heartbeat_interval=0.5, launch=status)
    fault = Detector(Detection()).check(obs)
    return None if fault is None else fault.kind


def test_a_frozen_aggregator_reads_as_unknown_its_nodes_asked_directly(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("relay.launchers.agent_client.GROUP_WAIT_SECONDS", 0.3)
    frozen = FrozenAgent()
    try:
        tree.channel.aggregators["aggregator-1"] = frozen.address
        _silent_since_long(tree.channel)
        tree.round()
        tree.channel.poll()
        assert sorted(tree.asked_directly) == ["node-c", "node-d"]
        assert tree.channel.groups.down == {"aggregator-1"}
        assert sorted(tree.channel.beats) == list(range(8))
        tree.agents._channel = tree.channel
        assert _detect(tree.agents) is None  # no node called unresponsive
    finally:
        frozen.close()


def test_a_stale_aggregator_whose_loop_is_stuck_is_down_not_its_nodes(
    tree: Tree, monkeypatch: pytest.MonkeyPatch
) -> None:
    _silent_since_long(tree.channel)
    tree.round()
    for report in tree.aggregators["aggregator-0"].channel.reports.values():
        report.received_at -= 30.0  # it last heard its nodes 30 s ago and answers on
    tree.channel.poll()
    assert sorted(tree.asked_directly) == ["node-a", "node-b"]
    assert all(time.time() - tree.channel.reports[n].received_at < 5 for n in NODES_OF)


def test_a_node_frozen_behind_a_working_aggregator_ages_and_is_called(tree: Tree) -> None:
    tree.round()
    # The aggregator last heard node-d 30 s ago (its beats as they were then), the rest now.
    tree.aggregators["aggregator-1"].channel.reports["node-d"].received_at -= 30.0
    tree.agents._channel = tree.channel
    assert _detect(tree.agents) == FaultKind.NODE_UNRESPONSIVE
    assert tree.asked_directly == []  # the aggregator answers: nobody asked node-d directly
    assert time.time() - tree.channel.reports["node-d"].received_at > 25


def test_an_unsigned_summary_is_not_used(root: Path) -> None:
    tree = Tree(root, secret=new_secret())  # aggregators that do not hold this attempt's secret
    try:
        _silent_since_long(tree.channel)
        tree.round()
        tree.channel.poll()
        assert sorted(tree.asked_directly) == sorted(NODES_OF)
        assert tree.channel.groups.down == set(GROUPS)
    finally:
        tree.close()


def test_a_summary_speaks_only_for_its_own_groups_nodes(tree: Tree) -> None:
    tree.round()
    group = tree.groups[0]
    heard = {"node-c": (time.time() - 0.1, {STATE: "failed", HEARTBEATS: []})}
    tree.channel._merge(group, time.time(), encode_summary(heard, time.time()))
    assert "node-c" not in tree.channel.reports


def test_a_nan_loss_survives_the_fast_json_decoder() -> None:
    assert parse_answer(b'{"loss": NaN}')["loss"] != parse_answer(b'{"loss": NaN}')["loss"]  # NaN
    assert parse_answer(b"not json") == {}


def test_the_local_launcher_reads_through_aggregator_processes(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The aggregator as the launcher would run it (``python -m relay.launchers.aggregator``,
    the secret on stdin), named in the attempt's handle: the launcher's status reads every
    node through the two of them, and asks no agent directly (none counts as down here,
    however slowly the processes start: the fallback is the tests' above)."""
    import json
    import subprocess
    import sys

    from relay.launchers.local.launcher import HANDLE_FILE, LocalLauncher, agent_handle, free_port

    monkeypatch.setattr(groups_module, "DOWN_AFTER_SECONDS", 3600.0)
    monkeypatch.setattr(groups_module, "ALL_DOWN_AFTER_SECONDS", 3600.0)
    agents = ServedAttempt(root, NODES_OF)
    procs: list[subprocess.Popen[bytes]] = []
    launcher = LocalLauncher()
    try:
        aggregators = {}
        for name, nodes in GROUPS.items():
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "relay.launchers.aggregator", attempt_id_of(root), name,
                 str(port), *(f"{n}={agents.addresses[n]}" for n in nodes)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(f"{agents.secret}\n".encode())
            proc.stdin.close()
            aggregators[name] = {"port": port, "nodes": list(nodes)}
        me = agent_handle(os.getpid())
        (root / HANDLE_FILE).write_text(json.dumps({
            "nodes": {n: {**me, "port": int(a.rsplit(":", 1)[1])}
                      for n, a in agents.addresses.items()},
            "aggregators": aggregators, "started_at": time.time(),
            "attempt_id": attempt_id_of(root)}))
        channel = launcher.channel(Attempt(root))
        asked: list[str] = []
        real = channel._status
        channel._status = lambda node: (asked.append(node), real(node))[1]  # type: ignore[method-assign]
        deadline = time.monotonic() + 60  # the aggregators start (an interpreter each)
        while len(channel.reports) < len(NODES_OF) and time.monotonic() < deadline:
            launcher.status(Attempt(root))
            time.sleep(0.1)  # an aggregator not yet listening refuses at once
        status = launcher.status(Attempt(root))
        assert sorted(status.heartbeats) == list(range(8))
        assert {s.state for s in status.nodes.values()} == {NodeState.RUNNING}
        assert asked == []
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        launcher.channel(Attempt(root)).close()
        agents.close()
