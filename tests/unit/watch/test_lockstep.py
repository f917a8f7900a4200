"""A node unheard while the other nodes' ranks step on is alive (relay.watch.lockstep): on
a loaded machine its agent's answer waits for a core, but the collective proves its
ranks joined every step. A frozen node or a stopped rank stops the others too, and is
called as soon as before."""

from __future__ import annotations

import pytest

from relay.core.attempt import AttemptState
from relay.core.faults import Fault, FaultKind
from relay.launchers.local.launcher import LaunchStatus, NodeStatus
from relay.policy.model import Detection
from relay.watch.columns import RankColumns
from relay.watch.detection import Detector
from relay.watch.lockstep import Lockstep
from relay.watch.observation import Observation
from relay_train.protocol.heartbeat import Heartbeat, Phase
from relay_train.protocol.routes import NodeState

NODE_RANKS = {"node-a": [0, 1], "node-b": [2, 3]}
NODE_OF = {r: n for n, ranks in NODE_RANKS.items() for r in ranks}
POLL = 0.5
STEPS_PER_POLL = 10
T0 = 1_700_000_000.0
CFG = Detection()


def columns(beats: dict[int, Heartbeat]) -> RankColumns:
    """Return one poll's records as the rules take them."""
    return RankColumns.of(beats.values())


def record(rank: int, step: int, written: float, phase: str = Phase.COLLECTIVE.value
           ) -> Heartbeat:
    return Heartbeat(rank=rank, node=NODE_OF[rank], pid=100 + rank, step=step, phase=phase,
                     phase_started_at=written - 0.01, compute_seconds=0.02, loss=1.0,
                     wall_clock=written, seq=step)


def status(now: float, heard: dict[str, float]) -> LaunchStatus:
    """A running launch whose agents last answered at ``heard[node]``."""
    return LaunchStatus(AttemptState.RUNNING, {
        n: NodeStatus(n, NodeState.RUNNING, dict.fromkeys(ranks), last_seen=heard[n])
        for n, ranks in NODE_RANKS.items()})


def job(silent_from: float | None, frozen: bool, rank_only: int | None = None,
        seconds: float = 12.0) -> tuple[float, Fault] | None:
    """Poll a healthy 2-node job; from ``silent_from`` node-b's agent (or rank ``rank_only``)
    is unheard. ``frozen``: it really stopped, so every rank stops stepping with it; else
    the others step on. Return the first fault and when (after ``silent_from``)."""
    detector = Detector(CFG, settled=True)
    last: dict[int, Heartbeat] = {}
    heard: dict[str, float] = {}
    for i in range(int(seconds / POLL)):
        now = T0 + i * POLL
        quiet = silent_from is not None and now >= silent_from
        step = 10 + STEPS_PER_POLL * i
        if quiet and frozen:
            step = 10 + STEPS_PER_POLL * int((silent_from - T0) / POLL)  # nobody steps on
        for node in NODE_RANKS:
            if not quiet or rank_only is not None or node == "node-a":
                heard[node] = now - 0.05
        for rank in NODE_OF:
            silent = quiet and (rank == rank_only if rank_only is not None
                                else NODE_OF[rank] == "node-b")
            if not silent:  # its records come through its agent: unheard, they stay old
                last[rank] = record(rank, step, now - 0.1)
        fault = detector.check(Observation(
            now=now, launched_at=T0 - 30, heartbeats=dict(last), node_ranks=NODE_RANKS,
            heartbeat_interval=POLL, launch=status(now, heard)))
        if fault is not None:
            return now - (silent_from or T0), fault
    return None


def test_a_node_unheard_while_the_others_step_on_is_not_silent() -> None:
    assert job(silent_from=T0 + 5.0, frozen=False) is None


def test_a_rank_unheard_while_the_others_step_on_is_not_silent() -> None:
    assert job(silent_from=T0 + 5.0, frozen=False, rank_only=2) is None


@pytest.mark.parametrize(("rank_only", "kind"), [
    (None, FaultKind.NODE_UNRESPONSIVE), (2, FaultKind.RANK_UNRESPONSIVE)])
def test_a_frozen_node_or_stopped_rank_is_called_as_soon_as_without_the_proof(
        rank_only: int | None, kind: FaultKind, monkeypatch: pytest.MonkeyPatch) -> None:
    found = job(silent_from=T0 + 5.0, frozen=True, rank_only=rank_only)
    assert found is not None and found[1].kind is kind, found
    monkeypatch.setattr(Lockstep, "alive_since", lambda *_: {})
    without = job(silent_from=T0 + 5.0, frozen=True, rank_only=rank_only)
    assert without is not None and without[1].kind is kind
    assert found[0] == without[0], "the proof of life ended with the fault"
    # (and without the proof, the node merely unheard is a false alarm: the test can fail)
    assert job(silent_from=T0 + 5.0, frozen=False, rank_only=rank_only) is not None


def test_the_proof_of_life_is_the_latest_step_of_another_node() -> None:
    lockstep = Lockstep()
    lockstep.observe(columns({0: record(0, 1, T0), 2: record(2, 1, T0)}))
    lockstep.observe(columns({0: record(0, 5, T0 + 1), 2: record(2, 1, T0 + 1)}))
    assert lockstep.alive_since(list(NODE_RANKS), NODE_OF.get) == {}, "one node stepped"
    lockstep.observe(columns({0: record(0, 5, T0 + 2), 2: record(2, 4, T0 + 2)}))
    lockstep.observe(columns({0: record(0, 9, T0 + 3), 2: record(2, 4, T0 + 3)}))
    # node-a's rank 0 moved on after its record at T0+2; node-b's rank 2 after T0+1
    assert lockstep.alive_since(list(NODE_RANKS), NODE_OF.get) == {
        "node-a": T0 + 1, "node-b": T0 + 2}


def starting(now: float, node_b_age: float, node_a_phase: str, launched: float = 30.0,
             node_b_phase: str = Phase.STARTING.value) -> Observation:
    """node-b's agent and its starting ranks unheard for ``node_b_age`` s; node-a's fresh,
    in ``node_a_phase`` at step 0 (its first step); launched ``launched`` s ago."""
    beats = {r: record(r, 0, now - 0.1, node_a_phase) for r in (0, 1)}
    beats |= {r: record(r, 0, now - node_b_age, node_b_phase) for r in (2, 3)}
    return Observation(now=now, launched_at=now - launched, heartbeats=beats,
                       node_ranks=NODE_RANKS, heartbeat_interval=POLL,
                       launch=status(now, {"node-a": now - 0.05, "node-b": now - node_b_age}))


@pytest.mark.parametrize("node_a_phase", [Phase.STARTING.value, Phase.COMPUTE.value],
                         ids=["all-starting", "node-a-in-its-first-step"])
def test_a_node_unheard_during_start_up_is_left_to_startup_timeout(node_a_phase: str) -> None:
    silent = CFG.heartbeat_timeout + 2.0
    assert Detector(CFG).check(starting(T0, silent, node_a_phase)) is None
    # (node-b silent in its first step once startup_timeout has passed is a fault)
    fault = Detector(CFG).check(starting(T0, silent, Phase.COMPUTE.value,
                                         launched=CFG.startup_timeout + 1.0,
                                         node_b_phase=Phase.COMPUTE.value))
    assert fault is not None and fault.kind is FaultKind.NODE_UNRESPONSIVE
    assert fault.culprit_node == "node-b"
