"""The channel between Relay and node agents: real HTTP on loopback, clocks, fencing.

The agent side is the real :class:`relay_train.agent.server.AgentServer` (served by
``tests/agents.py`` over a folder a test writes, without forking ranks); the
Relay side is the real :class:`relay.launchers.agent_client.AgentChannel`. The Kubernetes
test points the launcher's agent address at such a server: the API server is
the fake of ``tests/k8s_fake.py``, the channel is real.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from agents import ServedAttempt

from relay.core.attempt import Attempt
from relay.core.faults import FaultKind
from relay.launchers.agent_client import AgentChannel
from relay.policy.model import Detection
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay_train.agent.server import SERVE_POLL_SECONDS
from relay_train.protocol.env import ENV_CLOCK_SKEW
from relay_train.protocol.heartbeat import (
    HeartbeatWriter,
    Phase,
    clock_skew,
    read_heartbeats,
)
from relay_train.protocol.launch import BOUNDARIES_FILE, DRAIN_FILE
from relay_train.protocol.routes import NodeState, Route

NODES = {"node-a": [0, 1], "node-b": [2, 3]}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    attempt = tmp_path / "relay_t" / "run-1" / "segment-000" / "try-2"
    (attempt / "heartbeats").mkdir(parents=True)
    return attempt


@pytest.fixture
def agents(root: Path) -> Iterator[ServedAttempt]:
    served = ServedAttempt(root, NODES)
    yield served
    served.close()


def _beat_all(root: Path, step: int = 7, phase: Phase = Phase.COMPUTE) -> None:
    for node, ranks in NODES.items():
        for rank in ranks:
            writer = HeartbeatWriter(root / "heartbeats", rank, node, 1.0, step=step)
            writer.enter(phase)
            writer.beat(step=step, compute_seconds=0.05, samples_per_second=100.0, loss=2.0)
            writer.flush_now()


def _observe(beats: dict, agents: ServedAttempt | None = None) -> Observation:  # type: ignore[type-arg]
    status = agents.status(Attempt(agents.root)) if agents is not None else None
    return Observation(now=time.time(), launched_at=time.time() - 60, heartbeats=beats,
                       node_ranks=NODES, heartbeat_interval=0.5, launch=status)


def test_the_skew_hook_is_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CLOCK_SKEW, "node-b=30,node-c=-30")
    assert (clock_skew("node-a"), clock_skew("node-b"), clock_skew("node-c")) == (0, 30, -30)
    monkeypatch.setenv(ENV_CLOCK_SKEW, "-30")
    assert clock_skew("node-a") == -30


@pytest.mark.parametrize("skew", [30.0, -30.0])
def test_heartbeats_are_placed_on_relays_clock_whatever_the_nodes_clock(
    root: Path, agents: ServedAttempt, monkeypatch: pytest.MonkeyPatch, skew: float
) -> None:
    monkeypatch.setenv(ENV_CLOCK_SKEW, str(skew))  # the node's clock (writer and agent) is off
    _beat_all(root)
    on_disk = read_heartbeats(root / "heartbeats")
    assert all(abs(b.wall_clock - time.time() - skew) < 2 for b in on_disk.values())
    status = agents.status(Attempt(root))
    assert sorted(status.heartbeats) == [0, 1, 2, 3]
    for beat in status.heartbeats.values():
        assert abs(beat.wall_clock - time.time()) < 2  # received_at - age: Relay's own clock
        assert abs(beat.phase_started_at - time.time()) < 2
    assert Detector(Detection()).check(_observe(status.heartbeats, agents)) is None


def test_the_old_absolute_reading_alarms_on_a_node_clock_30s_behind(
    root: Path, agents: ServedAttempt, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CLOCK_SKEW, "-30")
    _beat_all(root)
    old = Detector(Detection()).check(_observe(read_heartbeats(root / "heartbeats")))
    assert old is not None and old.kind in (FaultKind.NODE_UNRESPONSIVE,
                                            FaultKind.RANK_UNRESPONSIVE), old
    beats = agents.status(Attempt(root)).heartbeats
    assert Detector(Detection()).check(_observe(beats, agents)) is None


def test_the_old_absolute_reading_misses_a_silent_node_whose_clock_is_30s_ahead(
    root: Path, agents: ServedAttempt, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CLOCK_SKEW, "30")
    _beat_all(root)
    for path in (root / "heartbeats").glob("rank-*.json"):  # last beats 10 s ago, node time
        record = json.loads(path.read_text())
        record["wall_clock"] -= 10
        record["phase_started_at"] -= 10
        path.write_text(json.dumps(record))
    old = _observe(read_heartbeats(root / "heartbeats"))
    assert all(old.now - b.wall_clock < 0 for b in old.heartbeats.values())  # "from the future"
    ages = [time.time() - b.wall_clock for b in agents.status(Attempt(root)).heartbeats.values()]
    assert all(9 < age < 12 for age in ages), ages  # the channel sees the 10 s of silence


def test_a_reply_from_another_attempt_is_refused_and_recorded(root: Path) -> None:
    stale = ServedAttempt(root, NODES, attempt_id="relay_t/run-1/segment-000/try-1")
    try:
        _beat_all(root, step=41)
        status = stale.status(Attempt(root))  # Relay watches try-2; the agents still serve try-1
        assert status.heartbeats == {}
        assert sorted(r["node"] for r in status.refused) == ["node-a", "node-b"]
        first = next(r for r in status.refused if r["node"] == "node-a")
        assert first["expected_attempt"] == "relay_t/run-1/segment-000/try-2"
        assert first["found_attempt"] == "relay_t/run-1/segment-000/try-1"
        assert (first["what"], first["heartbeats"], first["steps"]) == (Route.STATUS, 2, [41])
        channel = stale.channel(Attempt(root))
        assert channel.ask("node-a", Route.DRAIN, stop_at=50) is None  # the agent says 409
        assert not (root / DRAIN_FILE).exists()
        assert any(r["what"] == Route.DRAIN for r in channel.refused)
        stale.status(Attempt(root))
        assert [r["count"] for r in channel.refused if r["what"] == Route.STATUS] == [2, 2]
    finally:
        stale.close()


def test_requests_reach_the_node_and_name_their_attempt(root: Path, agents: ServedAttempt) -> None:
    channel = agents.channel(Attempt(root))
    # The wire format, spelled out: a change to it is a change to both sides.
    assert channel.ask("node-b", Route.DRAIN, stop_at=12) == {
        "attempt": channel.attempt_id, "node": "node-b", "stop_at": 12}
    assert json.loads((root / DRAIN_FILE).read_text()) == {"stop_at": 12}
    assert channel.ask("node-a", Route.STOP, reason="segment done") is not None
    assert agents.nodes["node-a"].stop_reasons == ["segment done"]
    assert channel.ask("node-a", Route.RESCUE, rank=3) is None  # rank 3 lives on node-b: 400


def test_a_silent_agent_costs_one_short_timeout_and_keeps_its_last_word(
    root: Path, agents: ServedAttempt
) -> None:
    _beat_all(root)
    agents.status(Attempt(root))
    seen = agents.channel(Attempt(root)).last_seen("node-b")
    agents.servers["node-b"].close()  # gone: connection refused from now on
    started = time.monotonic()
    status = agents.status(Attempt(root))
    assert time.monotonic() - started < 3
    assert agents.channel(Attempt(root)).last_seen("node-b") == seen
    assert sorted(status.heartbeats) == [0, 1, 2, 3]  # node-b's last beats, aging on our clock


def test_rank_0s_node_reports_the_boundaries_it_crossed_and_relay_keeps_them(
    root: Path, agents: ServedAttempt
) -> None:
    # Rank 0 appends to boundaries.jsonl in the attempt folder (here shared by both served
    # nodes, as on one machine): only the agent of its node reports it, the last few steps.
    lines = [json.dumps({"step": s, "loop_cost": 0.1}) for s in range(10, 210, 10)]
    (root / BOUNDARIES_FILE).write_text("\n".join(lines) + '\n{"step": 2')  # one half-written
    channel = agents.channel(Attempt(root))
    replies = channel.poll()
    assert replies["node-a"] is not None and replies["node-b"] is not None
    assert replies["node-a"].record["crossed"] == list(range(50, 210, 10))  # the last 16
    assert replies["node-b"].record["crossed"] == []  # rank 0 is not on node-b
    assert agents.status(Attempt(root)).crossed == set(range(50, 210, 10))
    agents.servers["node-a"].close()  # silent from now on: its last word still counts
    (root / BOUNDARIES_FILE).unlink()
    assert agents.status(Attempt(root)).crossed == set(range(50, 210, 10))


def test_a_node_without_a_boundary_record_reports_none(root: Path, agents: ServedAttempt) -> None:
    status = agents.status(Attempt(root))
    assert status.crossed == set()
    assert all(r.record["crossed"] == [] for r in agents.channel(Attempt(root)).reports.values())


def test_an_unreachable_address_is_not_an_answer() -> None:
    channel = AgentChannel("a/b/segment-000/try-1", {"node-a": "http://127.0.0.1:9"}, "s")
    assert channel.poll() == {"node-a": None}
    assert channel.last_seen("node-a") is None and channel.refused == []


def test_an_agent_cut_off_mid_reply_is_not_an_answer() -> None:
    """An agent exiting as its ranks stop may close the connection mid-reply; seen in
    `relay bench goodput` as an IncompleteRead that failed the task stopping the workload."""
    server = socket.create_server(("127.0.0.1", 0))

    def answer_half() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 123\r\n\r\n")

    thread = threading.Thread(target=answer_half)
    thread.start()
    try:
        channel = AgentChannel("a", {"node-a": "http://{}:{}".format(*server.getsockname())},
                               "s")
        assert channel.call_quietly("node-a", Route.STOP, 5.0) is None
    finally:
        thread.join()
        server.close()


def test_the_kubernetes_launcher_reads_pods_agents_over_the_channel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The API server is the fake (no cluster here); the pods' agents are real channel servers
    # on loopback, reached where a cluster would use the headless Service's DNS names.
    from k8s_fake import FakeApiServer
    from test_k8s_launcher import HOSTS, make_cfg, make_launcher

    from relay.launchers.k8s.objects import AttemptKey, agent_url

    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RELAY_NODES", ",".join(HOSTS))
    fake = FakeApiServer().start()
    for host in HOSTS:
        fake.add_node(host)
    launcher = make_launcher(fake, tmp_path)
    cfg = make_cfg(tmp_path, launcher)
    key = AttemptKey.from_dir(cfg.root)
    assert launcher.agent_url(key, 1) == agent_url(key, "default", 1) == (
        f"http://{key.name}-1.{key.name}.default.svc:29401")
    (cfg.root / "heartbeats").mkdir(parents=True)
    pods = ServedAttempt(cfg.root, {"pod-0": [0, 1], "pod-1": [2, 3]})
    try:
        monkeypatch.setattr(launcher, "agent_url", lambda _key, i: pods.addresses[f"pod-{i}"])
        # The pods' agents hold the secret the launcher makes for the attempt.
        monkeypatch.setattr("relay.launchers.k8s.launcher.new_secret", lambda: pods.secret)
        launcher.launch(cfg)
        fake.run_pods(key.name, ["gpu-1", "gpu-2"])
        for rank in range(4):
            writer = HeartbeatWriter(cfg.root / "heartbeats", rank, f"pod-{rank // 2}", 1.0)
            writer.beat(step=65)
            writer.flush_now()
        (cfg.root / BOUNDARIES_FILE).write_text(json.dumps({"step": 60}) + "\n")
        running = launcher.status(Attempt(cfg.root))
        assert running.crossed == {60}  # from pod-0's agent, which hosts rank 0
        assert sorted(running.heartbeats) == [0, 1, 2, 3]
        assert {b.step for b in running.heartbeats.values()} == {65}
        assert all(n.last_seen is not None for n in running.nodes.values())

        agent = pods.nodes["pod-1"]
        agent.state, agent.exit_codes = NodeState.FAILED, {2: 1, 3: -15}
        agent.errors = {2: "ZeroDivisionError: division by zero"}
        failed = launcher.status(Attempt(cfg.root))  # the pod is still Running: the agent lingers
        assert failed.nodes["pod-1"].state == NodeState.FAILED
        assert failed.errors() == {2: "ZeroDivisionError: division by zero"}
        assert failed.failed_ranks() == {2: 1, 3: -15}
    finally:
        pods.close()
        fake.stop()


def test_a_slow_answer_counts_at_the_next_poll_with_the_time_it_arrived(
    root: Path, agents: ServedAttempt, monkeypatch: pytest.MonkeyPatch
) -> None:
    _beat_all(root)
    slow = agents.nodes["node-b"]
    answer = slow.status_record
    monkeypatch.setattr(slow, "status_record", lambda: (time.sleep(4.0), answer())[1])
    channel = agents.channel(Attempt(root))
    started = time.monotonic()
    first = channel.poll()
    assert time.monotonic() - started < 3.5  # the poll did not wait for the slow agent
    assert first["node-a"] is not None and first["node-b"] is None
    channel._inflight["node-b"].result(timeout=30)  # node-b's answer arrives meanwhile
    time.sleep(0.3)
    asked = time.time()
    second = channel.poll()  # ...and counts at the next poll, from when it arrived
    assert second["node-b"] is not None
    assert second["node-b"].received_at < asked - 0.2
    # Its round trip, asked to answered, is measured (relay.watch.slow_link judges it)
    assert second["node-b"].round_trip is not None and second["node-b"].round_trip >= 4.0
    assert first["node-a"] is not None and first["node-a"].round_trip is not None
    assert sorted(channel.beats) == [0, 1, 2, 3]
    channel.close()


def test_a_frozen_agent_costs_one_wait_not_one_per_poll(
    root: Path, agents: ServedAttempt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll waits (up to FRESH_WAIT_SECONDS) only for the requests it sent: node-b's
    request from the first poll is still unanswered at the second, which asks node-a again
    and does not wait on node-b a second time (the watcher keeps its pace while a node is
    frozen, so the node is called as soon as it has been silent heartbeat_timeout)."""
    from agents import FrozenAgent

    import relay.launchers.agent_client as channel_module

    _beat_all(root)
    waited: list[int] = []
    real_wait = channel_module.wait

    def spy(futures: list, timeout: float) -> object:  # type: ignore[type-arg]
        waited.append(len(futures))
        return real_wait(futures, timeout=timeout)

    monkeypatch.setattr(channel_module, "wait", spy)
    monkeypatch.setattr(channel_module, "FRESH_WAIT_SECONDS", 2.0)  # node-a's bound
    frozen = FrozenAgent()
    try:
        channel = agents.channel(Attempt(root))
        channel.addresses["node-b"] = frozen.address
        first = channel.poll()
        second = channel.poll()
        assert first["node-b"] is None and second["node-b"] is None
        assert first["node-a"] is not None and second["node-a"] is not None
        assert waited == [2, 1]  # the second poll waited on node-a's new request only
        channel.close()
    finally:
        frozen.close()


def test_a_node_marked_silent_is_not_asked_again_and_keeps_its_last_word(
    root: Path, agents: ServedAttempt
) -> None:
    """A fault that found node-b frozen marks it: later polls (the heartbeats read before
    the rescue) and the stop's asks skip it instead of waiting out its timeout."""
    from agents import FrozenAgent

    _beat_all(root)
    agents.status(Attempt(root))
    frozen = FrozenAgent()
    try:
        channel = agents.channel(Attempt(root))
        channel.addresses["node-b"] = frozen.address  # node-b froze after its last answer
        channel.mark_silent({"node-b", "node-z"})  # a node the attempt lacks is ignored
        assert channel.silent == {"node-b"}
        status = agents.status(Attempt(root))
        assert not frozen.was_asked()
        assert sorted(status.heartbeats) == [0, 1, 2, 3]
        # Every launcher's stop asks through here: the yes-sayers come back, node-b is skipped.
        assert channel.ask_to_stop() == {"node-a"}
        assert not frozen.was_asked()
        assert agents.nodes["node-a"].stop_reasons == ["Relay asked over the channel"]
    finally:
        frozen.close()


def test_a_closing_server_notices_at_the_next_short_poll(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopping agent closes its server before it exits, and closing waits for the serve
    loop's next look at the shutdown flag: at http.server's default (every 0.5 s) that was
    most of the time a stop waited for the last workload's processes to go."""
    polls: list[float] = []
    serve = ThreadingHTTPServer.serve_forever
    monkeypatch.setattr(ThreadingHTTPServer, "serve_forever",
                        lambda server, poll_interval=0.5: polls.append(poll_interval)
                        or serve(server, poll_interval))
    served = ServedAttempt(root, {"node-a": [0]})
    served.close()
    assert polls == [SERVE_POLL_SECONDS] and SERVE_POLL_SECONDS <= 0.1


def test_rank_0s_first_step_sent_over_the_channel_lands_in_relays_attempt_folder(
        tmp_path: Path) -> None:
    from relay.launchers.agent_client import NodeReport
    from relay_train.protocol.launch import FIRST_STEP_FILE
    from relay_train.protocol.routes import FIRST_STEP

    channel = AgentChannel("attempt", {}, "secret")
    channel.reports["pod-1"] = NodeReport("pod-1", 1.0, {FIRST_STEP: None})
    channel.keep_node_records(tmp_path)
    assert not (tmp_path / FIRST_STEP_FILE).exists()

    first = {"step": 41, "at": 5.0, "node": "pod-0", "spawned_at": 1.0, "startup": {}}
    channel.reports["pod-0"] = NodeReport("pod-0", 2.0, {FIRST_STEP: first})
    channel.keep_node_records(tmp_path)
    assert json.loads((tmp_path / FIRST_STEP_FILE).read_text()) == first


def test_faults_injected_on_a_node_of_its_own_come_back_over_the_channel(
        tmp_path: Path) -> None:
    """An agent sends its node's chaos.jsonl in its status; Relay writes every node's
    strikes, oldest first, into its own attempt folder (the fault table's onset)."""
    from types import SimpleNamespace

    from relay.launchers.agent_client import NodeReport
    from relay.lineage.report import chaos_strikes
    from relay_train.agent.node_status import NodeStatus
    from relay_train.protocol.injection import CHAOS_LOG
    from relay_train.protocol.routes import CHAOS

    node_dir = tmp_path / "node"
    node_dir.mkdir()
    agent = SimpleNamespace(cfg=SimpleNamespace(root=node_dir), _chaos=(0, []))
    assert NodeStatus._strikes(agent) == []  # type: ignore[arg-type]
    late = {"kind": "stop_node", "step": 95, "at": 20.0, "node": "node2"}
    (node_dir / CHAOS_LOG).write_text(json.dumps(late) + "\n")
    assert NodeStatus._strikes(agent) == [late]  # type: ignore[arg-type]

    early = {"kind": "hang", "step": 35, "at": 10.0, "node": "node1"}
    channel = AgentChannel("attempt", {}, "secret")
    channel.reports["node2"] = NodeReport("node2", 1.0, {CHAOS: [late]})
    channel.keep_node_records(tmp_path)
    assert chaos_strikes(tmp_path) == [late]
    channel.reports["node1"] = NodeReport("node1", 2.0, {CHAOS: [early]})
    channel.keep_node_records(tmp_path)
    assert chaos_strikes(tmp_path) == [early, late]
