"""A loaded host's CPU waits are not a rank's slowness (relay.watch.spread.work, UsualWork):
the straggler rule judges compute less the time a rank waited for a CPU, and the
throughput rule has the ranks' own work as a second witness. Also the rank's side of it:
reading the kernel's run-queue figure (relay_train.cpu_wait)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from relay.core.faults import FaultKind
from relay.policy.model import Detection, ThroughputDetection
from relay.watch.columns import RankColumns
from relay.watch.detection import Detector
from relay.watch.hangs import find_hang
from relay.watch.observation import Observation
from relay.watch.slowness import ThroughputRule
from relay.watch.spread import work
from relay.watch.steptime import HangLimit, StepTimes
from relay_train.cpu_wait import CpuWait
from relay_train.protocol.heartbeat import Heartbeat, HeartbeatWriter, Phase, read_heartbeats

NODE_RANKS = {"node-a": [0, 1], "node-b": [2, 3]}
RANKS = [0, 1, 2, 3]
POLL = 0.5
T0 = 1_700_000_000.0
SAMPLES = 32.0  # samples a step, the job's


def columns(beats: dict[int, Heartbeat]) -> RankColumns:
    """Return one poll's records as the rules take them."""
    return RankColumns.of(beats.values())


def beat(rank: int, now: float, step: int, work_s: float, wait: float | None,
         step_s: float = 0.1) -> Heartbeat:
    return Heartbeat(rank=rank, node="node-a" if rank < 2 else "node-b", pid=100 + rank,
                     step=step, phase=(Phase.COMPUTE if (step + rank) % 2
                                       else Phase.COLLECTIVE).value,
                     phase_started_at=now - 0.1, compute_seconds=work_s + (wait or 0.0),
                     cpu_wait_seconds=wait, step_seconds=step_s,
                     samples_per_second=SAMPLES / step_s, loss=1.0, wall_clock=now - 0.05,
                     seq=step)


Plan = Callable[[int, int, random.Random], tuple[float, float | None]]  # (work, wait)


def run(plan: Plan, polls: int, seed: int = 5) -> tuple[Detector, FaultKind | None, int | None]:
    """Poll a job ``polls`` times, each rank's (work, wait) from ``plan(poll, rank, rng)``;
    return the detector, the first fault's kind and culprit rank."""
    detector, rng = Detector(Detection()), random.Random(seed)
    for i in range(polls):
        now = T0 + i * POLL
        figures = {r: plan(i, r, rng) for r in RANKS}
        obs = Observation(now=now, launched_at=T0 - 10,
                          heartbeats={r: beat(r, now, 10 + i, *figures[r]) for r in RANKS},
                          node_ranks=NODE_RANKS, heartbeat_interval=POLL)
        fault = detector.check(obs)
        if fault is not None:
            return detector, fault.kind, fault.culprit_rank
    return detector, None, None


def loaded(i: int, rank: int, rng: random.Random) -> tuple[float, float | None]:
    """A 2x oversubscribed host as measured: 10 ms of work, 5-80 ms waiting for a CPU."""
    return 0.010 + rng.uniform(-0.001, 0.001), rng.uniform(0.005, 0.080)


def test_work_is_compute_less_the_wait_and_the_whole_compute_where_not_said() -> None:
    assert work(beat(0, T0, 1, 0.010, 0.030)) == 0.010 + 0.030 - 0.030
    assert work(beat(0, T0, 1, 0.040, None)) == 0.040


def test_a_loaded_hosts_waits_raise_no_straggler_and_leave_the_policys_ratio() -> None:
    detector, kind, _ = run(loaded, 600)
    assert kind is None
    straggler = detector._straggler  # noqa: SLF001 - the ratio in force
    assert straggler is not None
    assert straggler.ratio == Detection().straggler.ratio  # type: ignore[union-attr]


def test_the_same_compute_without_the_waits_said_raises_the_ratio_in_force() -> None:
    """The control: the same wall-clock compute from ranks that do not say their waits is
    noise the ratio in force has to learn (it rises above the policy's)."""
    def unsaid(i: int, rank: int, rng: random.Random) -> tuple[float, float | None]:
        w, wait = loaded(i, rank, rng)
        return w + (wait or 0.0), None

    detector, _, _ = run(unsaid, 600)
    straggler = detector._straggler  # noqa: SLF001 - the ratio in force
    assert straggler is not None
    assert straggler.ratio > Detection().straggler.ratio  # type: ignore[union-attr]


def test_a_2x_straggler_is_called_through_a_loaded_hosts_waits() -> None:
    def slow_rank_3(i: int, rank: int, rng: random.Random) -> tuple[float, float | None]:
        w, wait = loaded(i, rank, rng)
        return (2 * w if rank == 3 and i >= 60 else w), wait

    _, kind, rank = run(slow_rank_3, 200)
    assert (kind, rank) == (FaultKind.STRAGGLER, 3)


# -- throughput: the ranks' work as a second witness ------------------------------


def throughput(rates_and_work: Callable[[int], tuple[float, float, float]], polls: int
               ) -> FaultKind | None:
    """Feed the throughput rule ``polls`` polls of (step time, work, wait) every rank shares;
    the baseline's polls dip to 0.6 of the rate now and then, so the floor in force sinks
    to 0.4 (the 0.6 policy floor lowered by the job's own dips)."""
    rule = ThroughputRule(ThroughputDetection(floor=0.6, sustained=5.0, warmup_steps=2,
                                              baseline=5.0))
    for i in range(polls):
        now = T0 + i * POLL
        step_s, w, wait = rates_and_work(i)
        active = [beat(r, now, 10 + i, w, wait, step_s) for r in RANKS]
        fault = rule.check(active, len(active), now)
        if fault is not None:
            return fault.kind
    return None


def baseline_then(after: Callable[[int], tuple[float, float, float]]
                  ) -> Callable[[int], tuple[float, float, float]]:
    def figures(i: int) -> tuple[float, float, float]:
        if i < 40:  # warm-up and baseline: 0.1 s steps, every fourth poll a dip
            return (0.1 / 0.6, 0.010, 0.060) if i % 4 == 0 else (0.1, 0.010, 0.030)
        return after(i)
    return figures


def test_a_slowdown_of_the_ranks_own_work_is_called_above_a_sunken_floor() -> None:
    """Every rank sleeps 0.1 s more a step: the rate falls to 0.5 of the baseline, above the
    floor in force (0.4), but the work added would alone sink the job below 0.6."""
    kind = throughput(baseline_then(lambda i: (0.2, 0.110, 0.030)), 120)
    assert kind is FaultKind.THROUGHPUT_DEGRADED


def test_a_slowdown_that_is_waiting_for_a_cpu_is_not() -> None:
    """The same rate, the ranks' work unchanged: the host's queue, not the job."""
    assert throughput(baseline_then(lambda i: (0.2, 0.010, 0.130)), 120) is None


# -- the rank's side: the kernel's run-queue figure --------------------------------


def test_cpu_wait_reads_the_second_field_of_schedstat_in_seconds(tmp_path: Path) -> None:
    stat = tmp_path / "schedstat"
    stat.write_text("123456 4500000000 7\n")
    waits = CpuWait(str(stat))
    assert waits.seconds() == 4.5
    stat.write_text("123456 4750000000 9\n")
    assert waits.seconds() == 4.75  # read afresh each time
    waits.close()
    assert waits.seconds() is None


def test_cpu_wait_is_unknown_where_the_kernel_does_not_say(tmp_path: Path) -> None:
    assert CpuWait(str(tmp_path / "missing")).seconds() is None
    garbled = tmp_path / "schedstat"
    garbled.write_text("nonsense\n")
    assert CpuWait(str(garbled)).seconds() is None


def test_this_threads_cpu_wait_never_goes_back() -> None:
    waits = CpuWait()
    first = waits.seconds()
    if first is None:
        pytest.skip("no /proc/thread-self/schedstat here (not Linux)")
    sum(range(200_000))
    second = waits.seconds()
    assert second is not None and second >= first >= 0.0


# -- the hang rule and the derived threshold ----------------------------------------


def stalled(waited: float | None) -> Observation:
    """Rank 1 in compute for 3 s (``waited`` of it waiting for a CPU), the others waiting."""
    now = T0 + 100
    beats = {r: beat(r, now, 50, 0.010, 0.0) for r in RANKS}
    for r in RANKS:
        beats[r].phase = Phase.COLLECTIVE.value
    beats[1].phase, beats[1].phase_started_at = Phase.COMPUTE.value, now - 3.0
    beats[1].phase_cpu_wait = waited
    return Observation(now=now, launched_at=T0, heartbeats=beats, node_ranks=NODE_RANKS,
                       heartbeat_interval=POLL)


def test_time_in_compute_spent_waiting_for_a_cpu_is_not_a_stall() -> None:
    limit = HangLimit(2.0, "")
    assert find_hang(stalled(2.5), Detection(), limit) is None
    fault = find_hang(stalled(0.5), Detection(), limit)  # 2.5 s of its own: stalled
    assert fault is not None and (fault.kind, fault.culprit_rank) == (FaultKind.HANG, 1)
    assert "0.5s of it waiting for a CPU" in fault.evidence["summary"]
    unsaid = find_hang(stalled(None), Detection(), limit)
    assert unsaid is not None and unsaid.culprit_rank == 1


def test_the_derived_step_time_leaves_out_the_computes_waits() -> None:
    """Steps of 0.1 s, 0.06 s of which waiting for a CPU: the step time sampled is 0.04 s;
    the same records with no wait said give 0.1 s."""
    said, unsaid = StepTimes(), StepTimes()
    for i in range(40):
        now = T0 + i * POLL
        records = {r: beat(r, now, 5 * i, 0.010, 0.060) for r in RANKS}
        for b in records.values():
            b.wall_clock, b.cpu_wait_total = now, 0.3 * i  # 5 steps a poll, 0.06 s each
        said.observe(columns(records), warmup_steps=0)
        for b in records.values():
            b.cpu_wait_total = None
        unsaid.observe(columns(records), warmup_steps=0)
    assert said.step_time is not None and unsaid.step_time is not None
    assert said.step_time == pytest.approx(0.04)
    assert unsaid.step_time == pytest.approx(0.1)


def test_a_record_says_how_much_of_its_phase_was_a_wait_for_a_cpu(tmp_path: Path) -> None:
    waited = [10.0]
    writer = HeartbeatWriter(tmp_path, rank=0, node="n0", interval_seconds=60)
    writer.watch_cpu_wait(lambda: waited[0])
    writer.enter(Phase.COMPUTE)  # the phase begins with 10 s waited so far
    waited[0] = 10.75
    writer.flush_now()
    assert read_heartbeats(tmp_path)[0].phase_cpu_wait == pytest.approx(0.75)
    writer.enter(Phase.COLLECTIVE)  # a new phase starts from nothing
    writer.flush_now()
    assert read_heartbeats(tmp_path)[0].phase_cpu_wait == 0.0
