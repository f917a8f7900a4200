"""Where a drain stops (a few steps ahead, never past the segment's end) and when it may end
(every rank that was running says it is done)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from agents import ServedAttempt

from relay.core.attempt import Attempt
from relay.recover.drain import (
    DRAIN_LEAD_SECONDS,
    DRAIN_LEAD_STEPS,
    done,
    drain,
    drain_target,
    step_rate,
)
from relay_train.protocol.heartbeat import Heartbeat, HeartbeatWriter, Phase
from relay_train.protocol.launch import DRAIN_FILE


def _beats(step: int = 12, **phases: Phase) -> dict[int, Heartbeat]:
    return {int(r[1:]): Heartbeat(rank=int(r[1:]), node="n", pid=1, step=step, phase=p.value)
            for r, p in phases.items()}


def test_a_drain_targets_a_few_steps_past_the_furthest_rank() -> None:
    beats = {**_beats(40, r0=Phase.COMPUTE), **_beats(42, r1=Phase.COLLECTIVE)}
    assert drain_target(beats, end_step=60) == 42 + DRAIN_LEAD_STEPS
    assert drain_target(beats, end_step=None) == 42 + DRAIN_LEAD_STEPS


def test_a_fast_job_is_drained_further_ahead_by_its_step_rate() -> None:
    # Unpaced ranks at 15 steps/s on Slurm were past a 2-step lead by the time the request
    # reached them (a heartbeat up to a second old): the drain timed out.
    before = {r: Heartbeat(rank=r, node="n", pid=1, step=100, wall_clock=50.0) for r in (0, 1)}
    after = {0: Heartbeat(rank=0, node="n", pid=1, step=106, wall_clock=50.4),  # 15 steps/s
             1: Heartbeat(rank=1, node="n", pid=1, step=103, wall_clock=50.3)}  # 10 steps/s
    assert step_rate(before, after) == pytest.approx(15.0)
    expected = 106 + DRAIN_LEAD_STEPS + int(15.0 * DRAIN_LEAD_SECONDS + 0.999)
    assert drain_target(after, end_step=None, rate=15.0) == expected > 106 + DRAIN_LEAD_STEPS
    assert drain_target(after, end_step=110, rate=15.0) == 110
    # Nothing moved (a stalled job, a slow step): the fixed lead alone.
    assert step_rate(before, before) == 0.0
    assert drain_target(before, end_step=None, rate=0.0) == 100 + DRAIN_LEAD_STEPS


def test_a_drain_never_targets_a_step_past_the_segments_end() -> None:
    # One run drained "to 62" with its segment ending at 60: the ranks stopped (and
    # checkpointed) at 60, so 62 named a step no checkpoint had.
    assert drain_target(_beats(59, r0=Phase.COMPUTE, r1=Phase.COMPUTE), end_step=60) == 60
    assert drain_target(_beats(60, r0=Phase.CHECKPOINT), end_step=60) == 60


def test_a_drain_ends_once_every_rank_is_done() -> None:
    before = _beats(r0=Phase.COMPUTE, r1=Phase.COMPUTE)
    assert not done(before, _beats(r0=Phase.DONE, r1=Phase.CHECKPOINT))  # rank 1 still saving
    assert not done(before, _beats(r0=Phase.DONE))  # rank 1 not heard
    assert done(before, _beats(r0=Phase.DONE, r1=Phase.DONE))


def test_the_agents_are_asked_to_drain_at_the_segments_end_at_the_latest(tmp_path: Path) -> None:
    root = tmp_path / "relay_t" / "run-1" / "segment-000" / "try-1"
    (root / "heartbeats").mkdir(parents=True)
    for rank in (0, 1):
        writer = HeartbeatWriter(root / "heartbeats", rank, "node-a", 1.0, step=59)
        writer.enter(Phase.COMPUTE)
        writer.flush_now()
    served = ServedAttempt(root, {"node-a": [0, 1]})
    try:
        # No time to finish (the ranks are the test's): only the request is looked at.
        assert drain(Attempt(root), 0.0, served, end_step=60) is None  # type: ignore[arg-type]
        assert json.loads((root / DRAIN_FILE).read_text()) == {"stop_at": 60}
    finally:
        served.close()
