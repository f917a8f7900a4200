"""Which nodes count as gone quiet, and when the watcher warms its spare (watch.warmer)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from relay.core.attempt import AttemptState
from relay.launchers.base import LaunchStatus, NodeStatus
from relay.launchers.local import spare
from relay.watch import warmer as warming
from relay.watch.warmer import Warmer, silent_nodes
from relay_train.protocol.routes import NodeState


def _status(**last_seen: float | None) -> LaunchStatus:
    nodes = {n: NodeStatus(n, NodeState.RUNNING, last_seen=t) for n, t in last_seen.items()}
    return LaunchStatus(AttemptState.RUNNING, nodes)


def test_only_an_agent_heard_before_and_quiet_since_is_silent() -> None:
    status = _status(**{"node-a": 99.5, "node-b": 98.0, "node-c": None})
    # node-c never answered: an agent still starting up, not a node that stopped
    assert silent_nodes(status, after=1.0) == ["node-b"]
    assert silent_nodes(status, after=2.5) == []
    assert silent_nodes(None, after=1.0) == []


def test_a_poll_that_waited_for_a_silent_agent_does_not_make_the_others_silent() -> None:
    # every node answered in the same poll, which then waited 1 s for a slow one: what
    # counts is the gap to the freshest answer, not the age at the end of the poll
    assert silent_nodes(_status(**{"node-a": 99.0, "node-b": 99.1}), after=1.0) == []
    assert silent_nodes(_status(**{"node-a": 98.0}), after=1.0) == []  # alone: no peer


def test_the_plan_names_the_first_free_node_or_nothing(tmp_path: Path) -> None:
    assert spare.plan(tmp_path, ["node-c", "node-d"], 60.0) == {
        "directory": str(tmp_path), "node": "node-c", "ttl": 60.0}
    assert spare.plan(tmp_path, [], 60.0) is None


def test_a_hang_on_its_way_is_suspected_before_it_is_called() -> None:
    """Rank 1 in compute past half the hang threshold while the others wait: no fault yet,
    but a suspicion (the watcher warms the spare a retry off rank 1's node needs)."""
    from relay.policy.model import Detection
    from relay.watch.detection import Detector
    from relay.watch.observation import Observation
    from relay_train.protocol.heartbeat import Heartbeat, Phase

    cfg = Detection()
    detector = Detector(cfg)
    now = 1_700_000_000.0
    stuck = cfg.hang_timeout * 0.75  # the threshold before warm-up is the policy's

    def beat(rank: int, phase: Phase, since: float) -> Heartbeat:
        return Heartbeat(rank=rank, node="node-a" if rank < 2 else "node-b", pid=rank,
                         step=50, phase=phase.value, phase_started_at=now - since,
                         compute_seconds=0.1, wall_clock=now, seq=50)

    beats = {r: beat(r, Phase.COMPUTE if r == 1 else Phase.COLLECTIVE, stuck if r == 1 else 0.5)
             for r in range(4)}
    obs = Observation(now=now, launched_at=now - 600, heartbeats=beats,
                      node_ranks={"node-a": [0, 1], "node-b": [2, 3]}, heartbeat_interval=0.5)
    assert detector.check(obs) is None
    assert "rank 1 in compute" in (detector.suspects(obs) or "")
    beats[1] = beat(1, Phase.COMPUTE, stuck / 3)  # a normal step: nothing suspected
    assert Detector(cfg).suspects(Observation(
        now=now, launched_at=now - 600, heartbeats=beats,
        node_ranks={"node-a": [0, 1], "node-b": [2, 3]}, heartbeat_interval=0.5)) is None


def test_the_warmer_keeps_one_live_spare_and_warms_again_after_its_ttl(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A sign that proved false must not leave a real fault a minute later without a spare,
    and a sign at every poll must not preload at every poll."""
    import asyncio

    clock = [1000.0]
    monkeypatch.setattr(warming.time, "monotonic", lambda: clock[0])
    warmed: list[str] = []
    launcher = SimpleNamespace(continuity=SimpleNamespace(
        warm_spare=lambda plan, why: warmed.append(why)))
    warmer = Warmer(spare.plan(tmp_path, ["node-c"], 60.0), launcher=launcher)

    async def signs(*whys: str | None) -> None:
        for why in whys:
            await warmer.sign(why)

    asyncio.run(signs(None, "rank 3 half way to a straggler", "rank 3 half way to a straggler"))
    assert warmed == ["rank 3 half way to a straggler"]  # once, while it may be waiting
    clock[0] += 30.0
    asyncio.run(signs("the agent(s) of node-b stopped answering"))
    assert len(warmed) == 1 and not warmer.due(clock[0])
    clock[0] += 31.5  # its ttl ran out: it left by itself
    assert warmer.due(clock[0])
    asyncio.run(signs("the agent(s) of node-b stopped answering"))
    assert warmed[-1] == "the agent(s) of node-b stopped answering"
    assert not Warmer(None, launcher=launcher).due(clock[0])  # no free node: nothing to warm
    # A launcher without warm starts (Kubernetes) has nothing to warm either.
    assert not Warmer(spare.plan(tmp_path, ["node-c"], 60.0),
                      launcher=SimpleNamespace(continuity=None)).due(clock[0])
