"""The hang threshold derived from the job's own step time: its arithmetic, bounds and use.

Synthetic heartbeats with explicit clocks (no processes, no sleeps). Thresholds are
read from :class:`Detection` objects, never hard-coded.
"""

from __future__ import annotations

import random

import pytest

from relay.detection import Detector, Observation
from relay.faults import FaultKind
from relay.policy import Detection, HangFromStepTime
from relay.steptime import StepTimes
from relay_train.heartbeat import Heartbeat, Phase

NODE_RANKS = {"node-a": [0, 1], "node-b": [2, 3]}
INTERVAL = 0.5
T0 = 1_800_000_000.0
DERIVE = HangFromStepTime()
CFG = Detection(derive_hang_timeout=DERIVE)


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
    times.observe({0: beat(0, 0, T0)}, warmup_steps=20)
    times.observe({0: beat(0, 10, T0 + 0.5)}, warmup_steps=20)  # still in warm-up
    limit = times.hang_limit(3.0, INTERVAL, 10.0, 1.5)
    assert (limit.seconds, limit.how) == (3.0, "")


@pytest.mark.parametrize(("step_time", "expected", "held"), [
    (0.01, DERIVE.min, "(held at its min)"),  # 0.5 + 10 x 0.01 = 0.6 -> min
    (0.15, 0.5 + 10 * 0.15, ""),                 # within the bounds
    (1.0, 3.0, "(held at the policy's hang_timeout)"),  # 10.5 -> the policy's ceiling
])
def test_derived_threshold_is_lag_plus_factor_times_slowest_step_within_bounds(
    step_time: float, expected: float, held: str
) -> None:
    times = StepTimes()
    for i in range(60):  # mean step time between records, past the warm-up
        times.observe({0: beat(0, i * 5, T0 + i * 5 * step_time)}, warmup_steps=20)
    assert times.slowest == pytest.approx(step_time, rel=1e-4)
    limit = times.hang_limit(3.0, INTERVAL, DERIVE.safety_factor, DERIVE.min)
    assert limit.seconds == pytest.approx(expected)
    assert held in limit.how and "slowest step" in limit.how


def test_the_slowest_interval_counts_not_the_mean() -> None:
    times = StepTimes()
    wall = T0
    for i in range(40):
        wall += 0.5 if i != 30 else 2.0  # one slow stretch of 5 steps
        times.observe({0: beat(0, (i + 1) * 5, wall)}, warmup_steps=20)
    assert times.slowest == pytest.approx(2.0 / 5)


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
    # Steps of 20-80 ms at random: the threshold covers the slowest, with a factor of 10.
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
    from relay.explain import fault_sentence

    derived = fault_sentence(FaultKind.HANG, CFG)
    assert "DERIVED from the job's own steps" in derived
    assert f"{DERIVE.safety_factor:g} x the slowest step seen" in derived
    assert f"until {DERIVE.warmup_steps} steps are seen" in derived
    written = fault_sentence(FaultKind.HANG, Detection())
    assert "DERIVED" not in written and "3 seconds" in written
