"""Each rank's last step, kept by the rules as one record updated in place
(:class:`~relay.watch.observation.StepSeen`), must say exactly what the tuple made afresh
each poll said before: the lockstep proof, the step-time samples and the stepping ranks
are compared with the tuple versions (kept here as the reference) on random sequences of
polls (ranks missing, steps standing still, going back, jumping; clocks not moving on;
checkpoints; every phase).
"""

from __future__ import annotations

import random
import statistics

import pytest

from relay.policy.model import Detection
from relay.watch.detection import Detector
from relay.watch.lockstep import Lockstep
from relay.watch.observation import WORKING, Observation
from relay.watch.steptime import StepTimes
from relay_train.protocol.heartbeat import Heartbeat, Phase

PHASES = [Phase.COMPUTE.value] * 4 + [Phase.COLLECTIVE.value] * 4 + [
    Phase.CHECKPOINT.value, Phase.STARTING.value, Phase.DONE.value]


class TupleLockstep(Lockstep):
    """Lockstep's observe as it was: a new (step, wall clock) tuple a rank a poll."""

    def __init__(self) -> None:
        super().__init__()
        self.tuples: dict[int, tuple[int, float]] = {}

    def observe(self, beats: dict[int, Heartbeat]) -> None:
        for rank, beat in beats.items():
            last = self.tuples.get(rank)
            if last is not None and beat.step > last[0]:
                self._moved_after[rank] = last[1]
            if last is None or beat.step != last[0] or beat.wall_clock > last[1]:
                self.tuples[rank] = (beat.step, beat.wall_clock)


class TupleStepTimes(StepTimes):
    """StepTimes' observe as it was: a new (step, wall clock) tuple a rank a poll."""

    def __init__(self) -> None:
        super().__init__()
        self.tuples: dict[int, tuple[int, float]] = {}

    def observe(self, beats: dict[int, Heartbeat], warmup_steps: int) -> None:
        if not beats:
            return
        low = min(b.step for b in beats.values())
        if self._first_step is None:
            self._first_step = low
        checkpointing = any(b.phase == Phase.CHECKPOINT.value for b in beats.values())
        if checkpointing:
            self._checkpointed.update(beats)
        times: list[float] = []
        for rank, beat in beats.items():
            last = self.tuples.get(rank)
            if last is not None and beat.step > last[0] and beat.wall_clock > last[1]:
                if rank not in self._checkpointed and last[0] >= self._first_step + warmup_steps:
                    times.append((beat.wall_clock - last[1]) / (beat.step - last[0]))
                if not checkpointing:
                    self._checkpointed.discard(rank)
            if last is None or beat.step != last[0]:
                self.tuples[rank] = (beat.step, beat.wall_clock)
        if times:
            self._samples.append(statistics.median(times))


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
                                    wall_clock=wall[rank])
        out.append((now, beats))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_lockstep_and_step_times_in_place_say_what_fresh_tuples_said(seed: int) -> None:
    lockstep, ref_lockstep = Lockstep(), TupleLockstep()
    steps, ref_steps = StepTimes(), TupleStepTimes()
    nodes = [f"node-{n}" for n in range(4)]
    node_of = {r: f"node-{r // 4}" for r in range(16)}.get
    for now, beats in _polls(seed, ranks=16, polls=120):
        lockstep.observe(beats)
        ref_lockstep.observe(beats)
        steps.observe(beats, warmup_steps=5)
        ref_steps.observe(beats, warmup_steps=5)
        assert {r: (s.step, s.at) for r, s in lockstep._last.items()} == ref_lockstep.tuples
        assert lockstep._moved_after == ref_lockstep._moved_after, f"poll at {now}"
        assert lockstep.alive_since(nodes, node_of) == ref_lockstep.alive_since(nodes, node_of)
        assert {r: (s.step, s.at) for r, s in steps._last.items()} == ref_steps.tuples
        assert list(steps._samples) == list(ref_steps._samples), f"poll at {now}"
        assert steps._checkpointed == ref_steps._checkpointed


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
        assert {r: (s.step, s.at) for r, s in detector._stepped.items()} == stepped
