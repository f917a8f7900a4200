"""The straggler rule counts what a slow rank costs the job from the ranks' compute totals.

A step-by-step simulation of a data-parallel job: every step each rank computes, then
all wait for the slowest in the collective. The watcher polls every 0.5 s and sees each
rank's record as of its last finished step: the smoothed per-step compute (an EWMA, as
``relay_train.api`` reports it) and, from workers that report it, the total.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from relay.core.faults import Fault, FaultKind
from relay.policy.model import Detection
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay_train.protocol.heartbeat import Heartbeat, Phase
from relay_train.timing import Ewma

NODE_RANKS = {"node-a": [0, 1], "node-b": [2, 3]}
POLL = 0.5
COMPUTE = 0.05  # a healthy rank's compute per step
COLLECTIVE = 0.03  # the rest of a step
T0 = 1_700_000_000.0
CFG = Detection()
BUDGET = CFG.straggler.lost_seconds if CFG.straggler else None
assert BUDGET is not None, "the default policy calls a straggler on what it costs"


def simulate(compute_of: Callable[[int, int], float], seconds: float,
             totals: bool) -> tuple[list[tuple[float, float]], Fault | None]:
    """Run the job for ``seconds`` under a settled detector; return the job's true lost
    time at each poll (what it waited beyond the ranks' median compute) and the first
    fault. ``compute_of(rank, step)``: that rank's compute time for that step."""
    detector = Detector(CFG, settled=True)
    ewma = {r: Ewma() for rank in NODE_RANKS.values() for r in rank}
    total = dict.fromkeys(ewma, 0.0)
    clock, step, lost, next_poll = T0, 0, 0.0, T0 + POLL
    seen: list[tuple[float, float]] = []
    while clock < T0 + seconds:
        times = {r: compute_of(r, step) for r in ewma}
        ordered = sorted(times.values())
        lost += max(times.values()) - (ordered[1] + ordered[2]) / 2
        for r, spent in times.items():
            ewma[r].add(spent)
            total[r] += spent
        clock += max(times.values()) + COLLECTIVE
        step += 1
        while next_poll <= clock:
            seen.append((next_poll, lost))
            beats = {r: Heartbeat(rank=r, node="node-a" if r < 2 else "node-b", pid=r,
                                  step=step, phase=Phase.COLLECTIVE.value,
                                  phase_started_at=next_poll - 0.01,
                                  compute_seconds=ewma[r].value,
                                  compute_total=total[r] if totals else None,
                                  wall_clock=next_poll - 0.01)
                     for r in ewma}
            fault = detector.check(Observation(now=next_poll, launched_at=T0 - 60,
                                               heartbeats=beats, node_ranks=NODE_RANKS,
                                               heartbeat_interval=POLL))
            if fault is not None:
                return seen, fault
            next_poll += POLL
    return seen, None


def straggler_from(step: int, factor: float) -> Callable[[int, int], float]:
    return lambda rank, s: COMPUTE * (factor if rank == 3 and s >= step else 1.0)


@pytest.mark.parametrize("factor", [3.0, 6.0])
def test_called_at_the_first_poll_after_the_job_lost_lost_seconds(factor: float) -> None:
    seen, fault = simulate(straggler_from(40, factor), 30.0, totals=True)
    assert fault is not None and fault.kind is FaultKind.STRAGGLER
    assert fault.culprit_rank == 3
    lost_by_poll = dict(seen)
    called = fault.detected_at
    assert lost_by_poll[called] >= BUDGET  # never before the job really lost the budget
    polls = sorted(lost_by_poll)
    before = polls[polls.index(called) - 1]
    assert lost_by_poll[before] < BUDGET + factor * COMPUTE  # at most a poll and a step late
    assert fault.evidence["lost_seconds"] == pytest.approx(lost_by_poll[called], abs=0.01)


def test_the_smoothed_figure_alone_calls_the_same_straggler_later() -> None:
    """Without the totals (an older worker) the rule counts the EWMA's excess, which
    reaches a sudden slowdown over several steps, from the second slow poll on."""
    _, exact = simulate(straggler_from(40, 3.0), 30.0, totals=True)
    _, smoothed = simulate(straggler_from(40, 3.0), 30.0, totals=False)
    assert exact is not None and smoothed is not None
    assert exact.detected_at < smoothed.detected_at


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_jitter_and_single_slow_steps_are_no_straggler(seed: int) -> None:
    """Every rank's steps vary by 20%, and 1 step in 20 is 2-6x as slow, on any rank."""
    rng = random.Random(seed)

    def jittery(rank: int, step: int) -> float:
        return COMPUTE * (rng.uniform(2.0, 6.0) if rng.random() < 0.05
                          else rng.uniform(0.8, 1.2))

    _, fault = simulate(jittery, 120.0, totals=True)
    assert fault is None, fault.describe() if fault else ""
