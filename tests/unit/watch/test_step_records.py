"""Each rank's last step, kept by the rules in arrays indexed by rank and worked out over a
poll's columns (:mod:`relay.watch.columns`), must say exactly what a Python record a rank
said before: the lockstep proof, the step-time samples and the stepping ranks are compared
with per-rank tuple versions (kept here as the reference) on random sequences of polls
(ranks missing, steps standing still, going back, jumping; clocks not moving on;
checkpoints; every phase; ranks' CPU waits).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable

import pytest

from relay.policy.model import Detection
from relay.watch.columns import RankColumns
from relay.watch.detection import Detector
from relay.watch.lockstep import Lockstep
from relay.watch.observation import WORKING, Observation
from relay.watch.steptime import StepTimes
from relay_train.protocol.heartbeat import Heartbeat, Phase

PHASES = [Phase.COMPUTE.value] * 4 + [Phase.COLLECTIVE.value] * 4 + [
    Phase.CHECKPOINT.value, Phase.STARTING.value, Phase.DONE.value]


class TupleLockstep:
    """Lockstep's observe as it was: a (step, wall clock) tuple a rank, in a dict."""

    def __init__(self) -> None:
        self.tuples: dict[int, tuple[int, float]] = {}
        self.moved_after: dict[int, float] = {}

    def observe(self, beats: dict[int, Heartbeat]) -> None:
        for rank, beat in beats.items():
            last = self.tuples.get(rank)
            if last is not None and beat.step > last[0]:
                self.moved_after[rank] = last[1]
            if last is None or beat.step != last[0] or beat.wall_clock > last[1]:
                self.tuples[rank] = (beat.step, beat.wall_clock)


class TupleStepTimes:
    """StepTimes' observe as it was: a (step, clock less CPU waits) tuple a rank, in a dict."""

    def __init__(self) -> None:
        self.tuples: dict[int, tuple[int, float]] = {}
        self.checkpointed: set[int] = set()
        self.samples: list[float] = []
        self.first_step: int | None = None

    def observe(self, beats: dict[int, Heartbeat], warmup_steps: int) -> None:
        if not beats:
            return
        low = min(b.step for b in beats.values())
        if self.first_step is None:
            self.first_step = low
        checkpointing = any(b.phase == Phase.CHECKPOINT.value for b in beats.values())
        if checkpointing:
            self.checkpointed.update(beats)
        times: list[float] = []
        for rank, beat in beats.items():
            last = self.tuples.get(rank)
            at = beat.wall_clock - (beat.cpu_wait_total or 0.0)
            if last is not None and beat.step > last[0] and at > last[1]:
                if rank not in self.checkpointed and last[0] >= self.first_step + warmup_steps:
                    times.append((at - last[1]) / (beat.step - last[0]))
                if not checkpointing:
                    self.checkpointed.discard(rank)
            if last is None or beat.step != last[0]:
                self.tuples[rank] = (beat.step, at)
        if times:
            self.samples.append(statistics.median(times))


def _polls(seed: int, ranks: int, polls: int) -> list[tuple[float, dict[int, Heartbeat]]]:
    """Return a random job: per poll, the time and the records heard (new objects each)."""
    rng = random.Random(seed)
    step = dict.fromkeys(range(ranks), 0)
    wall = dict.fromkeys(range(ranks), 0.0)
    out = []
    for i in range(polls):
        now = 1_000.0 + 0.5 * i
        beats = {}
        for rank in range(ranks):
            if rng.random() < 0.1:
                continue  # not heard this poll
            step[rank] = max(0, step[rank] + rng.choice([0, 0, 1, 1, 3, 7, -1]))
            if rng.random() < 0.8:  # the record moved on (else the same clock again)
                wall[rank] = now - rng.uniform(0.0, 0.6)
            beats[rank] = Heartbeat(rank=rank, node=f"node-{rank // 4}", pid=1,
                                    step=step[rank], phase=rng.choice(PHASES),
                                    phase_started_at=wall[rank] - 0.1,
                                    wall_clock=wall[rank],
                                    cpu_wait_total=rng.choice([None, 0.01 * i, 0.02 * i]))
        out.append((now, beats))
    return out


def alive_since(ref: TupleLockstep, nodes: list[str], node_of: Callable[[int], str | None]
                ) -> dict[str, float]:
    """Lockstep.alive_since as it was, over the reference's dict."""
    best: dict[str, float] = {}
    for rank, after in ref.moved_after.items():
        node = node_of(rank)
        if node is not None and after > best.get(node, -math.inf):
            best[node] = after
    if len(best) < 2:
        return {}
    (top_node, top), (_, second) = sorted(best.items(), key=lambda i: i[1], reverse=True)[:2]
    return {node: second if node == top_node else top for node in nodes}


@pytest.mark.parametrize("seed", range(6))
def test_lockstep_and_step_times_over_columns_say_what_per_rank_tuples_said(seed: int) -> None:
    lockstep, ref_lockstep = Lockstep(), TupleLockstep()
    steps, ref_steps = StepTimes(), TupleStepTimes()
    nodes = [f"node-{n}" for n in range(4)]
    node_of = {r: f"node-{r // 4}" for r in range(16)}.get
    for now, beats in _polls(seed, ranks=16, polls=120):
        cols = RankColumns.of(beats.values())
        lockstep.observe(cols)
        ref_lockstep.observe(beats)
        steps.observe(cols, warmup_steps=5)
        ref_steps.observe(beats, warmup_steps=5)
        assert lockstep.last_seen() == ref_lockstep.tuples
        assert lockstep.moved_after() == ref_lockstep.moved_after, f"poll at {now}"
        assert lockstep.alive_since(nodes, node_of) == alive_since(ref_lockstep, nodes, node_of)
        assert steps.last_seen() == ref_steps.tuples
        assert list(steps._samples) == ref_steps.samples, f"poll at {now}"
        assert steps.checkpointed() == ref_steps.checkpointed


@pytest.mark.parametrize("seed", range(6))
def test_the_stepping_ranks_in_place_are_those_fresh_tuples_gave(seed: int) -> None:
    cfg = Detection()
    detector = Detector(cfg)
    stepped: dict[int, tuple[int, float]] = {}  # the reference: a new tuple on each step
    node_ranks = {f"node-{n}": list(range(4 * n, 4 * n + 4)) for n in range(4)}
    for now, beats in _polls(seed, ranks=16, polls=120):
        obs = Observation(now=now, launched_at=900.0, heartbeats=beats, node_ranks=node_ranks,
                          heartbeat_interval=0.5)
        detector.check(obs)
        for rank, beat in beats.items():
            seen = stepped.get(rank)
            if seen is None or beat.step != seen[0]:
                stepped[rank] = (beat.step, now)
        want = [b for b in beats.values() if b.phase in WORKING
                and now - stepped[b.rank][1] <= cfg.hang_timeout / 2]
        assert detector._active(obs) == want, f"poll at {now}"
        assert detector.stepped() == stepped
