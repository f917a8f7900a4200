"""Each rank's last step, kept by the rules in arrays indexed by rank and worked out over a
poll's columns (:mod:`relay.watch.columns`), must say exactly what a Python record a rank
said before: the lockstep proof, the step-time samples and the stepping ranks are compared
with per-rank tuple versions (kept here as the reference) on random sequences of polls
(ranks missing, steps standing still, going back, jumping; clocks not moving on;
checkpoints; every phase; ranks' CPU waits).
"""

from __future__ import annotations

import random
import statistics

import pytest

from relay.core.faults import Fault, FaultKind
from relay.policy.model import Detection
from relay.watch.columns import RankColumns
from relay.watch.detection import Detector
from relay.watch.hangs import _hang_fault, find_hang
from relay.watch.lockstep import Lockstep, alive_since
from relay.watch.observation import WAITING, WORKING, Observation
from relay.watch.steptime import HangLimit, StepTimes
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
        assert lockstep.alive_since(nodes, node_of) == alive_since(ref_lockstep.moved_after,
                                                                   nodes, node_of)
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
        assert detector._active(obs).beats == want, f"poll at {now}"
        assert detector.stepped() == stepped


def reference_due_at(detector: Detector, obs: Observation) -> float | None:
    """Detector.due_at as it was: one pass over the heartbeat objects."""
    now, timeout = obs.now, detector.cfg.heartbeat_timeout
    beats = [b for b in obs.heartbeats.values() if b.phase != Phase.DONE.value]
    hang = FaultKind.HANG in detector.enabled and any(b.phase in WAITING for b in beats)
    limit = detector.hang_limit(obs).seconds if hang else 0.0
    silence = bool(detector.enabled & {FaultKind.NODE_UNRESPONSIVE,
                                       FaultKind.RANK_UNRESPONSIVE})
    soonest: float | None = None
    for b in beats if hang or silence else ():
        if hang and b.phase == Phase.COMPUTE.value:
            t = b.phase_started_at + limit
            if t > now and (soonest is None or t < soonest):
                soonest = t
        if silence:
            t = b.wall_clock + timeout
            if t > now and (soonest is None or t < soonest):
                soonest = t
    return soonest


@pytest.mark.parametrize("seed", range(6))
def test_due_times_and_silent_ranks_over_columns_are_what_the_per_rank_passes_said(
        seed: int) -> None:
    rng = random.Random(seed)
    detector = Detector(Detection())
    node_ranks = {f"node-{n}": list(range(4 * n, 4 * n + 4)) for n in range(4)}
    for now, beats in _polls(seed, ranks=16, polls=120):
        for b in beats.values():  # phases begun anywhere from 3 s ago to now
            b.phase_started_at = now - rng.uniform(0.0, 3.0)
        obs = Observation(now=now, launched_at=900.0, heartbeats=beats, node_ranks=node_ranks,
                          heartbeat_interval=0.5)
        detector.check(obs)
        for later in (0.0, 1.7, 2.5):  # so that some ranks are over the thresholds
            seen = Observation(now=now + later, launched_at=900.0, heartbeats=beats,
                               node_ranks=node_ranks, heartbeat_interval=0.5)
            assert detector.due_at(seen) == reference_due_at(detector, seen), f"at {now}"
            for idle in (Phase.DONE.value, Phase.STARTING.value):
                want = {r for r, b in beats.items() if b.phase not in (Phase.DONE.value, idle)
                        and seen.now - b.wall_clock > detector.cfg.heartbeat_timeout}
                assert detector._silent(seen, idle) == want, f"at {seen.now}, idle {idle}"


def reference_find_hang(obs: Observation, cfg: Detection, limit: HangLimit) -> Fault | None:
    """find_hang as it was: one pass over the heartbeat objects."""
    now = obs.now
    beats = [b for b in obs.heartbeats.values() if b.phase != Phase.DONE.value]
    if not beats:
        return None
    lag, hang_timeout = 3 * obs.heartbeat_interval, cfg.hang_timeout
    computing: list[Heartbeat] = []
    waiting = working = 0
    working_all_over = True
    in_phase = {b.rank: now - b.phase_started_at for b in beats}
    for b in beats:
        if b.phase == Phase.CHECKPOINT.value:
            if now - b.phase_started_at > cfg.checkpoint_timeout:
                return _hang_fault(obs, b, in_phase, "stuck saving a checkpoint",
                                   f"checkpoint_timeout {cfg.checkpoint_timeout:g}s")
            continue
        if b.phase not in WORKING:
            continue
        if b.phase in WAITING:
            waiting += 1
        if now - b.wall_clock > lag:
            continue
        working += 1
        seconds = now - b.phase_started_at
        working_all_over = working_all_over and seconds > hang_timeout
        if b.phase == Phase.COMPUTE.value and seconds - (b.phase_cpu_wait or 0.0) > limit.seconds:
            computing.append(b)
    if computing and waiting:
        culprit = max(computing,
                      key=lambda b: now - b.phase_started_at - (b.phase_cpu_wait or 0.0))
        return _hang_fault(obs, culprit, in_phase, "stalled in compute "
                           f"while {waiting} rank(s) wait in the collective", limit.describe())
    if working and working == len(beats) and working_all_over and all(
            r in obs.heartbeats for r in obs.expected_ranks):
        return Fault(FaultKind.HANG, None, None,
                     {"summary": f"no rank made progress for {hang_timeout:g}s",
                      "seconds_in_phase": {r: round(s, 2) for r, s in in_phase.items()},
                      "steps": {b.rank: b.step for b in beats}}, obs.now)
    return None


@pytest.mark.parametrize("seed", range(8))
def test_the_hang_rule_over_columns_finds_what_the_per_rank_pass_found(seed: int) -> None:
    """Random phases, phase ages, CPU waits and silences; some polls with every rank in
    compute or the collective (the all-busy hang), some with a checkpoint stuck."""
    rng = random.Random(seed)
    cfg = Detection(hang_timeout=2.0, checkpoint_timeout=2.5)
    node_ranks = {f"node-{n}": list(range(4 * n, 4 * n + 4)) for n in range(4)}
    found = {False: 0, True: 0}  # hangs with a culprit, and every rank busy at once
    for now, beats in _polls(seed, ranks=16, polls=200):
        busy = rng.random() < 0.3
        for b in beats.values():
            b.phase_started_at = now - rng.choice([0.1, 1.0, 2.2, 3.0, rng.uniform(0.0, 4.0)])
            b.phase_cpu_wait = rng.choice([None, 0.0, 0.5, 1.5])
            if busy:  # every rank heard lately, in the collective (or just begun computing)
                b.phase = rng.choice([Phase.COMPUTE.value] + [Phase.COLLECTIVE.value] * 30)
                b.wall_clock = now - rng.uniform(0.0, 1.6)
                b.phase_started_at = now - (rng.uniform(1.95, 4.0) if b.phase != "compute"
                                            else rng.uniform(0.0, 2.5))
        # the ranks heard are the job's (as in a busy poll): else the all-busy hang waits
        ranks = {n: [r for r in rs if r in beats] for n, rs in node_ranks.items()} if busy \
            else node_ranks
        obs = Observation(now=now, launched_at=900.0, heartbeats=beats, node_ranks=ranks,
                          heartbeat_interval=0.5)
        limit = HangLimit(rng.choice([1.0, 2.0, 2.5]), "")
        want = reference_find_hang(obs, cfg, limit)
        assert find_hang(obs, cfg, limit) == want, f"poll at {now}"
        if want is not None:
            found[want.culprit_rank is None] += 1
    assert found[False] > 10 and found[True] > 3, f"too few hangs of each kind: {found}"
