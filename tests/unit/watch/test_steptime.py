"""The hang threshold derived from the job's own step time: its arithmetic, bounds and use.

Synthetic heartbeats with explicit clocks (no processes, no sleeps). Thresholds are
read from :class:`Detection` objects, never hard-coded.
"""

from __future__ import annotations

import math
import random

import pytest

from relay.core.faults import FaultKind
from relay.policy.model import Detection, HangFromStepTime
from relay.watch.columns import RankColumns
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay.watch.steptime import WINDOW, StepTimes
from relay_train.protocol.heartbeat import Heartbeat, Phase

NODE_RANKS = {"node-a": [0, 1], "node-b": [2, 3]}
INTERVAL = 0.5
T0 = 1_800_000_000.0
DERIVE = HangFromStepTime()
CFG = Detection(derive_hang_timeout=DERIVE)


def columns(beats: dict[int, Heartbeat]) -> RankColumns:
    """Return one poll's records as the rules take them."""
    return RankColumns.of(beats.values())


def beat(rank: int, step: int, wall: float, phase: str = Phase.COLLECTIVE.value,
         phase_started: float | None = None) -> Heartbeat:
    return Heartbeat(rank=rank, node="node-a" if rank < 2 else "node-b", pid=100 + rank,
                     step=step, phase=phase,
                     phase_started_at=wall if phase_started is None else phase_started,
                     compute_seconds=0.01, samples_per_second=100.0, loss=1.0,
                     wall_clock=wall, seq=step)


def observe(now: float, beats: list[Heartbeat]) -> Observation:
    return Observation(now=now, launched_at=T0 - 60, heartbeats={b.rank: b for b in beats},
                       node_ranks=NODE_RANKS, heartbeat_interval=INTERVAL)


def run_steps(detector: Detector, seconds: float, step_time: float,
              jitter: float = 0.0, seed: int = 1) -> tuple[float, int]:
    """Feed ``seconds`` of a healthy job at ``step_time`` per step; return (now, step)."""
    rng = random.Random(seed)
    now, step = T0, 0
    while now < T0 + seconds:
        now += INTERVAL
        step += max(int(INTERVAL / (step_time + rng.uniform(0, jitter))), 1)
        beats = [beat(r, step, now - rng.uniform(0, 0.05)) for r in range(4)]
        fault = detector.check(observe(now, beats))
        assert fault is None, fault.describe()
    return now, step


def test_no_derivation_before_warmup_uses_the_policys_hang_timeout() -> None:
    times = StepTimes()
    times.observe(columns({0: beat(0, 0, T0)}), warmup_steps=20)
    times.observe(columns({0: beat(0, 10, T0 + 0.5)}), warmup_steps=20)  # still in warm-up
    limit = times.hang_limit(3.0, INTERVAL, 10.0, 1.5)
    assert (limit.seconds, limit.how) == (3.0, "")


@pytest.mark.parametrize(("step_time", "expected", "held"), [
    (0.01, DERIVE.min, "(held at its min)"),  # 0.5 + 10 x 0.01 = 0.6 -> min
    (0.15, 0.5 + 10 * 0.15, ""),                 # within the bounds
    (1.0, 3.0, "(held at the policy's hang_timeout)"),  # 10.5 -> the policy's ceiling
])
def test_derived_threshold_is_lag_plus_factor_times_p95_step_within_bounds(
    step_time: float, expected: float, held: str
) -> None:
    times = StepTimes()
    for i in range(60):  # mean step time between records, past the warm-up
        times.observe(columns({0: beat(0, i * 5, T0 + i * 5 * step_time)}), warmup_steps=20)
    assert times.step_time == pytest.approx(step_time, rel=1e-4)
    limit = times.hang_limit(3.0, INTERVAL, DERIVE.safety_factor, DERIVE.min)
    assert limit.seconds == pytest.approx(expected)
    assert held in limit.how and "p95 step" in limit.how and "checkpoints left out" in limit.how


def feed(times: StepTimes, step_times: list[float], *, ranks: int = 4,
         checkpoint_at: frozenset[int] = frozenset()) -> None:
    """Feed one poll per entry: every rank advanced at that mean step time since the last.

    At the polls in ``checkpoint_at`` rank 0's record shows it checkpointing.
    """
    wall, step = T0, 0
    times.observe(columns({r: beat(r, step, wall) for r in range(ranks)}), warmup_steps=0)
    for i, seconds in enumerate(step_times):
        steps = max(round(INTERVAL / seconds), 1)
        step += steps
        wall += steps * seconds
        times.observe(columns({r: beat(r, step, wall, Phase.CHECKPOINT.value
                                       if r == 0 and i in checkpoint_at
                                       else Phase.COLLECTIVE.value)
                               for r in range(ranks)}), warmup_steps=0)


def threshold(times: StepTimes) -> float:
    return times.hang_limit(CFG.hang_timeout, INTERVAL, DERIVE.safety_factor, DERIVE.min).seconds


def test_one_slow_interval_does_not_hold_the_threshold_at_the_ceiling() -> None:
    # 60 polls at 20 ms a step, one of them at 0.5 s a step (CPU contention): the single
    # slowest would put the threshold at 0.5 + 10 x 0.5 -> the ceiling for the whole window.
    times = StepTimes()
    feed(times, [0.5 if i == 30 else 0.02 for i in range(60)])
    assert times.step_time == pytest.approx(0.02)
    assert threshold(times) == DERIVE.min < CFG.hang_timeout


def test_a_checkpoint_pause_is_left_out_however_often_it_comes() -> None:
    # A checkpoint every 10th poll; the poll that sees it and the next are slow for every
    # rank (they wait for rank 0's snapshot): 20% of the polls, too many for a p95 to drop.
    ckpt = frozenset(range(5, 60, 10))
    slow = ckpt | {i + 1 for i in ckpt}
    times = StepTimes()
    feed(times, [0.5 if i in slow else 0.02 for i in range(60)], checkpoint_at=ckpt)
    assert times.step_time == pytest.approx(0.02)
    assert threshold(times) == DERIVE.min
    # The same slowness without a checkpoint to explain it lifts the threshold.
    plain = StepTimes()
    feed(plain, [0.5 if i in slow else 0.02 for i in range(60)])
    assert plain.step_time == pytest.approx(0.5)
    assert threshold(plain) == CFG.hang_timeout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_slowness_that_recurs_still_holds_the_threshold_up(seed: int) -> None:
    # 1 poll in 10 at 10x the step time (a busy machine): that is the job's normal pace
    # too, so the threshold covers it with the full safety factor.
    rng = random.Random(seed)
    pace = [0.2 if rng.random() < 0.1 else 0.02 for _ in range(WINDOW)]
    times = StepTimes()
    feed(times, pace)
    assert times.step_time == pytest.approx(0.2)
    assert threshold(times) == pytest.approx(INTERVAL + DERIVE.safety_factor * 0.2)


def test_under_jitter_the_threshold_covers_all_but_the_slowest_5_percent() -> None:
    rng = random.Random(11)
    pace = [rng.lognormvariate(math.log(0.1), 0.4) for _ in range(WINDOW)]
    times = StepTimes()
    feed(times, pace)
    limit = threshold(times)
    covered = [p for p in pace if INTERVAL + DERIVE.safety_factor * p <= limit + 1e-6]
    assert len(covered) >= 0.95 * len(pace)
    assert limit > DERIVE.min, "this jitter is slow enough to lift the threshold off its min"


def test_a_job_that_checkpoints_regularly_still_gets_the_derived_threshold() -> None:
    """Before: every checkpoint interval held the threshold at hang_timeout for 120 intervals."""
    detector = Detector(CFG)
    now, step = T0, 0
    for i in range(120):
        now += INTERVAL
        phase = Phase.CHECKPOINT.value if i % 20 == 19 else Phase.COLLECTIVE.value
        if i % 20 == 0 and i:
            now += 1.5  # the ranks waited for the snapshot: 2 s for this one step
            step += 1
        else:
            step += 25  # 20 ms a step
        beats = [beat(r, step, now - 0.05, phase if r == 0 else Phase.COLLECTIVE.value,
                      phase_started=now - 0.3) for r in range(4)]
        assert detector.check(observe(now, beats)) is None
    limit = detector.hang_limit(observe(now, []))
    assert limit.seconds == DERIVE.min < CFG.hang_timeout
    assert "held at its min" in limit.describe()


def test_a_fast_job_hang_is_caught_sooner_than_the_policys_timeout() -> None:
    detector = Detector(CFG)
    now, step = run_steps(detector, 20.0, step_time=0.02)
    limit = detector.hang_limit(observe(now, []))
    assert DERIVE.min <= limit.seconds < CFG.hang_timeout
    stalled = limit.seconds + 0.3  # over the derived threshold, under the policy's
    assert stalled < CFG.hang_timeout
    t = now + stalled
    beats = [beat(1, step, t - 0.1, Phase.COMPUTE.value, phase_started=t - stalled)] + [
        beat(r, step, t - 0.1, Phase.COLLECTIVE.value, phase_started=t - stalled + 0.05)
        for r in (0, 2, 3)]
    fault = detector.check(observe(t, beats))
    assert fault is not None and fault.kind is FaultKind.HANG and fault.culprit_rank == 1
    assert "derived:" in fault.evidence["summary"], fault.evidence["summary"]
    # The same stall under the policy as written is not (yet) a hang.
    plain = Detector(Detection())
    run_steps(plain, 20.0, step_time=0.02)
    assert plain.check(observe(t, beats)) is None


def test_jitter_is_inside_the_derived_threshold() -> None:
    # Steps of 20-80 ms at random: the threshold covers them, with a factor of 10.
    detector = Detector(CFG)
    now, _ = run_steps(detector, 60.0, step_time=0.02, jitter=0.06, seed=7)
    limit = detector.hang_limit(observe(now, []))
    assert limit.seconds >= INTERVAL + DERIVE.safety_factor * 0.02
    assert limit.seconds <= CFG.hang_timeout


def test_without_the_section_the_threshold_is_the_policys() -> None:
    detector = Detector(Detection())
    now, _ = run_steps(detector, 20.0, step_time=0.02)
    limit = detector.hang_limit(observe(now, []))
    assert (limit.seconds, limit.how) == (Detection().hang_timeout, "")


def test_policy_explain_says_the_hang_threshold_is_derived_and_from_what(tmp_path) -> None:
    from relay.policy.explain import fault_sentence

    derived = fault_sentence(FaultKind.HANG, CFG)
    assert "DERIVED from the job's own steps" in derived
    assert f"{DERIVE.safety_factor:g} x the job's 95th-percentile step time" in derived
    assert "checkpoint pauses left out" in derived
    assert f"until {DERIVE.warmup_steps} steps are seen" in derived
    written = fault_sentence(FaultKind.HANG, Detection())
    assert "DERIVED" not in written and "3 seconds" in written
