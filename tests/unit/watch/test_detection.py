"""Table-driven unit tests for :class:`relay.watch.detection.Detector` on synthetic observations.

No processes and no sleeps: time is driven by setting ``now``, ``wall_clock`` and
``phase_started_at`` explicitly, and the "sustained" rules are fed polls with an
increasing ``now``. Two nodes with two ranks each (node-a: 0, 1; node-b: 2, 3).
Thresholds are read from a default :class:`Detection`, never hard-coded.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from relay.core.attempt import AttemptState
from relay.core.faults import Fault, FaultKind
from relay.launchers.local.launcher import LaunchStatus, NodeStatus
from relay.policy.model import MIN_SLOW_STEPS, Detection, StragglerDetection
from relay.watch.detection import AGENT_STATUS_INTERVAL_SECONDS, Detector
from relay.watch.observation import Observation
from relay_train.protocol.heartbeat import Heartbeat, HeartbeatWriter, Phase, read_heartbeats
from relay_train.protocol.routes import NodeState

NODE_RANKS = {"node-a": [0, 1], "node-b": [2, 3]}
NODE_OF = {r: n for n, ranks in NODE_RANKS.items() for r in ranks}
RANKS = sorted(NODE_OF)
INTERVAL = 0.5  # heartbeat interval and poll interval of these tests
CFG = Detection()
STRAGGLER = CFG.straggler
THROUGHPUT = CFG.throughput
assert STRAGGLER is not None and THROUGHPUT is not None, "default Detection has both rules on"

LAUNCHED = 1_700_000_000.0
# Well past start-up, so that the start-up rule is armed in every test.
T0 = LAUNCHED + CFG.startup_timeout + 60.0

COMPUTE = Phase.COMPUTE.value
COLLECTIVE = Phase.COLLECTIVE.value
CHECKPOINT = Phase.CHECKPOINT.value
STARTING = Phase.STARTING.value
DONE = Phase.DONE.value

_RUNNING = object()  # sentinel: "a running launch whose agents are all fresh"


def hb(
    rank: int,
    now: float,
    *,
    phase: str = COMPUTE,
    step: int = 10,
    in_phase: float = 0.2,
    age: float = 0.1,
    compute: float | None = 0.2,
    sps: float | None = None,
    loss: float | None = 1.0,
) -> Heartbeat:
    """Return rank ``rank``'s record: in ``phase`` for ``in_phase`` s, written ``age`` s ago."""
    return Heartbeat(
        rank=rank,
        node=NODE_OF[rank],
        pid=1000 + rank,
        step=step,
        phase=phase,
        phase_started_at=now - in_phase,
        compute_seconds=compute,
        samples_per_second=sps,
        loss=loss,
        wall_clock=now - age,
        seq=step,
    )


def running(now: float, *, agent_age: dict[str, float | None] | None = None) -> LaunchStatus:
    """Return a RUNNING launch status; agents seen ``agent_age[node]`` s ago (default: now)."""
    ages = agent_age or {}
    nodes = {}
    for node, ranks in NODE_RANKS.items():
        age = ages.get(node, 0.0)
        nodes[node] = NodeStatus(
            node, NodeState.RUNNING, {r: None for r in ranks},
            last_seen=None if age is None else now - age,
        )
    return LaunchStatus(AttemptState.RUNNING, nodes)


def observe(
    now: float,
    beats: list[Heartbeat],
    *,
    launch: object = _RUNNING,
    launched_at: float = LAUNCHED,
) -> Observation:
    """Return an observation of ``beats`` at ``now``."""
    return Observation(
        now=now,
        launched_at=launched_at,
        heartbeats={b.rank: b for b in beats},
        node_ranks={n: list(r) for n, r in NODE_RANKS.items()},
        heartbeat_interval=INTERVAL,
        launch=running(now) if launch is _RUNNING else launch,  # type: ignore[arg-type]
    )


def check(obs: Observation, cfg: Detection = CFG) -> Fault | None:
    """Run a fresh detector once."""
    return Detector(cfg).check(obs)


def assert_fault(
    fault: Fault | None, kind: FaultKind, rank: int | None, node: str | None, *mentions: str
) -> Fault:
    assert fault is not None, f"expected {kind}, got no fault"
    assert fault.kind is kind, fault.describe()
    assert fault.culprit_rank == rank, fault.describe()
    assert fault.culprit_node == node, fault.describe()
    summary = fault.evidence["summary"]
    for text in mentions:
        assert text in summary, f"{text!r} not in {summary!r}"
    return fault


def polls(start: float, seconds: float) -> list[float]:
    """Return poll times every INTERVAL from ``start`` for ``seconds`` (inclusive)."""
    n = int(round(seconds / INTERVAL))
    return [start + i * INTERVAL for i in range(n + 1)]


def healthy(now: float, i: int, *, jitter: Callable[[], float] = lambda: 1.0) -> list[Heartbeat]:
    """Return poll ``i`` of a healthy job: alternating phases, fresh records, steady speed."""
    return [
        hb(
            r, now,
            phase=COMPUTE if (i + r) % 2 == 0 else COLLECTIVE,
            step=10 + i,
            in_phase=0.05 + 0.1 * r + (i % 3) * 0.1,
            age=((i * 0.13) + r * 0.1) % INTERVAL,
            compute=0.2 * jitter(),
            sps=1000.0 * (1.0 + (jitter() - 1.0) / 3),
            loss=2.0 - 0.001 * i,
        )
        for r in RANKS
    ]


# -- healthy ---------------------------------------------------------------------


@pytest.mark.parametrize("spread", [0.0, 0.3], ids=["steady", "jitter-30pct"])
def test_healthy_job_never_faults_over_many_polls(spread: float) -> None:
    rng = random.Random(20240601)
    detector = Detector(CFG)
    for i, now in enumerate(polls(T0, 120.0)):
        beats = healthy(now, i, jitter=lambda: rng.uniform(1.0 - spread, 1.0 + spread))
        fault = detector.check(observe(now, beats))
        assert fault is None, f"poll {i}: {fault.describe()}"
    assert detector.baseline is not None, "the throughput baseline was measured"


# -- hang ------------------------------------------------------------------------


def test_rank_stuck_in_compute_while_others_wait_is_a_hang() -> None:
    stuck = CFG.hang_timeout + 0.5
    beats = [hb(1, T0, phase=COMPUTE, in_phase=stuck, step=42)] + [
        hb(r, T0, phase=COLLECTIVE, in_phase=stuck - 0.1, step=42) for r in (0, 2, 3)
    ]
    fault = assert_fault(
        check(observe(T0, beats)), FaultKind.HANG, 1, "node-a",
        f"{stuck:.1f}s", f"hang_timeout {CFG.hang_timeout:g}s", "step 42",
    )
    assert fault.evidence["step"] == 42
    assert fault.evidence["seconds_in_phase"][1] == round(stuck, 2)
    assert fault.detected_at == T0


def test_rank_in_compute_just_under_hang_timeout_is_not_a_hang() -> None:
    nearly = CFG.hang_timeout - 0.05
    beats = [hb(1, T0, phase=COMPUTE, in_phase=nearly)] + [
        hb(r, T0, phase=COLLECTIVE, in_phase=nearly - 0.1) for r in (0, 2, 3)
    ]
    assert check(observe(T0, beats)) is None


@pytest.mark.parametrize("phase", [COLLECTIVE, COMPUTE])
def test_every_rank_stuck_is_a_job_wide_hang(phase: str) -> None:
    stuck = CFG.hang_timeout + 1.0
    beats = [hb(r, T0, phase=phase, in_phase=stuck + 0.1 * r) for r in RANKS]
    fault = assert_fault(
        check(observe(T0, beats)), FaultKind.HANG, None, None, f"{CFG.hang_timeout:g}s"
    )
    assert set(fault.evidence["seconds_in_phase"]) == set(RANKS)


def test_long_checkpoint_below_checkpoint_timeout_is_not_a_hang() -> None:
    saving = (CFG.hang_timeout + CFG.checkpoint_timeout) / 2
    assert CFG.hang_timeout < saving < CFG.checkpoint_timeout
    beats = [hb(0, T0, phase=CHECKPOINT, in_phase=saving)] + [
        hb(r, T0, phase=COLLECTIVE, in_phase=saving - 0.1) for r in (1, 2, 3)
    ]
    assert check(observe(T0, beats)) is None


def test_checkpoint_longer_than_checkpoint_timeout_is_a_hang() -> None:
    saving = CFG.checkpoint_timeout + 10.0
    beats = [hb(0, T0, phase=CHECKPOINT, in_phase=saving, step=50)] + [
        hb(r, T0, phase=COLLECTIVE, in_phase=saving - 0.1, step=50) for r in (1, 2, 3)
    ]
    assert_fault(
        check(observe(T0, beats)), FaultKind.HANG, 0, "node-a",
        "checkpoint", f"{saving:.1f}s",
    )


def test_checkpoint_hang_evidence_names_checkpoint_timeout() -> None:
    saving = CFG.checkpoint_timeout + 10.0
    beats = [hb(0, T0, phase=CHECKPOINT, in_phase=saving)] + [
        hb(r, T0, phase=COLLECTIVE, in_phase=saving - 0.1) for r in (1, 2, 3)
    ]
    fault = assert_fault(check(observe(T0, beats)), FaultKind.HANG, 0, "node-a")
    summary = fault.evidence["summary"]
    assert f"checkpoint_timeout {CFG.checkpoint_timeout:g}s" in summary
    assert "hang_timeout" not in summary


# -- rank and node unresponsive ------------------------------------------------


def test_stale_rank_with_fresh_agent_is_rank_unresponsive() -> None:
    silent = CFG.heartbeat_timeout + 0.5
    beats = [hb(r, T0, phase=COLLECTIVE) for r in (0, 1, 3)] + [
        hb(2, T0, phase=COMPUTE, age=silent, in_phase=silent + 0.1, step=17)
    ]
    fault = assert_fault(
        check(observe(T0, beats)), FaultKind.RANK_UNRESPONSIVE, 2, "node-b",
        f"{silent:.1f}s", f"heartbeat_timeout {CFG.heartbeat_timeout:g}s", "step 17",
    )
    assert fault.evidence["heartbeat_age_seconds"] == round(silent, 2)
    assert fault.evidence["pid"] == 1002


def test_rank_silent_just_under_heartbeat_timeout_is_fine() -> None:
    beats = [hb(r, T0, phase=COLLECTIVE) for r in (0, 1, 3)] + [
        hb(2, T0, age=CFG.heartbeat_timeout - 0.05, in_phase=CFG.heartbeat_timeout)
    ]
    assert check(observe(T0, beats)) is None


def test_done_rank_with_old_heartbeat_is_not_stale() -> None:
    beats = [hb(r, T0, phase=COLLECTIVE) for r in (0, 1, 2)] + [
        hb(3, T0, phase=DONE, age=CFG.heartbeat_timeout * 50, in_phase=CFG.heartbeat_timeout * 50)
    ]
    assert check(observe(T0, beats)) is None


AGENT_SILENT = CFG.heartbeat_timeout + AGENT_STATUS_INTERVAL_SECONDS + 0.5
# The agent still speaks (within one status interval plus two heartbeats): a lone rank froze.
AGENT_ALIVE = AGENT_STATUS_INTERVAL_SECONDS + 2 * INTERVAL - 0.1
# Between alive and silent: its last word came too soon after the ranks' last beats to
# show the node alive (under AGENT_STATUS_INTERVAL_SECONDS + 0.25 s after them), yet it
# has not been silent for heartbeat_timeout: the node may be going dark as a whole, so wait.
AGENT_FADING = CFG.heartbeat_timeout - 0.02


def node_b_silent(now: float) -> list[Heartbeat]:
    silent = CFG.heartbeat_timeout + 1.0
    return [hb(r, now, phase=COLLECTIVE) for r in (0, 1)] + [
        hb(2, now, age=silent, in_phase=silent + 0.1),
        hb(3, now, age=silent + 0.2, in_phase=silent + 0.3),  # the older of the two
    ]


@pytest.mark.parametrize(
    ("launch", "kind", "rank"),
    [
        pytest.param(
            lambda now: running(now, agent_age={"node-b": AGENT_SILENT}),
            FaultKind.NODE_UNRESPONSIVE, None, id="agent-silent",
        ),
        pytest.param(
            lambda now: running(now, agent_age={"node-b": None}),
            FaultKind.NODE_UNRESPONSIVE, None, id="agent-never-seen",
        ),
        pytest.param(lambda now: None, FaultKind.NODE_UNRESPONSIVE, None, id="sensor-mode"),
        pytest.param(
            lambda now: running(now), FaultKind.RANK_UNRESPONSIVE, 3, id="agent-fresh",
        ),
        pytest.param(
            lambda now: running(now, agent_age={"node-b": AGENT_ALIVE}),
            FaultKind.RANK_UNRESPONSIVE, 3, id="agent-still-alive",
        ),
        pytest.param(
            lambda now: running(now, agent_age={"node-b": AGENT_FADING}),
            None, None, id="agent-fading-wait",
        ),
    ],
)
def test_whole_node_silent(
    launch: Callable[[float], LaunchStatus | None], kind: FaultKind | None, rank: int | None
) -> None:
    fault = check(observe(T0, node_b_silent(T0), launch=launch(T0)))
    silent = CFG.heartbeat_timeout + 1.0
    if kind is None:
        assert fault is None
    elif kind is FaultKind.NODE_UNRESPONSIVE:
        fault = assert_fault(fault, kind, None, "node-b", "node-b")
        assert fault.evidence["heartbeat_age_seconds"] == {
            2: round(silent, 2), 3: round(silent + 0.2, 2)
        }
    else:
        assert_fault(fault, kind, rank, "node-b", f"{silent + 0.2:.1f}s")


@pytest.mark.parametrize("silent_for", [0.5, 5.0])
def test_sigstopped_rank_is_unresponsive_not_hung(silent_for: float) -> None:
    # SIGSTOP freezes the heartbeat thread too: "compute, stale". Once the record
    # is older than heartbeat_timeout the stale rule must win over the hang rule.
    stuck = CFG.hang_timeout + silent_for
    age = CFG.heartbeat_timeout + silent_for
    beats = [hb(1, T0, phase=COMPUTE, in_phase=stuck, age=age)] + [
        hb(r, T0, phase=COLLECTIVE, in_phase=stuck - 0.2) for r in (0, 2, 3)
    ]
    assert_fault(
        check(observe(T0, beats)), FaultKind.RANK_UNRESPONSIVE, 1, "node-a", f"{age:.1f}s"
    )


def test_stuck_rank_whose_heartbeat_thread_still_writes_is_a_hang() -> None:
    stuck = CFG.hang_timeout + 0.5
    beats = [hb(1, T0, in_phase=stuck, age=3 * INTERVAL - 0.1)] + [
        hb(r, T0, phase=COLLECTIVE, in_phase=stuck - 0.2) for r in (0, 2, 3)
    ]
    assert_fault(check(observe(T0, beats)), FaultKind.HANG, 1, "node-a")


def test_stuck_rank_that_missed_beats_is_not_called_hung_yet() -> None:
    # Three missed beats but not yet heartbeat_timeout: probably frozen (SIGSTOP),
    # so neither rule may fire until the unresponsive rule can name it.
    stuck = CFG.hang_timeout + 0.5
    beats = [hb(1, T0, in_phase=stuck, age=CFG.heartbeat_timeout - 0.1)] + [
        hb(r, T0, phase=COLLECTIVE, in_phase=stuck - 0.2) for r in (0, 2, 3)
    ]
    assert check(observe(T0, beats)) is None


# -- straggler -------------------------------------------------------------------


def straggling(now: float, i: int, slow: dict[int, float]) -> list[Heartbeat]:
    """Return a healthy poll where rank r's compute time is multiplied by ``slow[r]``."""
    return [
        hb(
            r, now,
            phase=COMPUTE if (i + r) % 2 == 0 else COLLECTIVE,
            step=10 + i,
            in_phase=0.1,
            compute=0.2 * slow.get(r, 1.0),
        )
        for r in RANKS
    ]


def first_fault(
    detector: Detector, times: list[float], beats: Callable[[float, int], list[Heartbeat]]
) -> tuple[float, Fault] | None:
    """Poll until the first fault; return its time and the fault."""
    for i, now in enumerate(times):
        fault = detector.check(observe(now, beats(now, i)))
        if fault is not None:
            return now, fault
    return None


def settled(cfg: Detection = CFG) -> Detector:
    """Return a detector that watched a healthy job through the straggler rule's start-up
    (``sustained``, in which nothing is judged) until just before T0."""
    detector = Detector(cfg)
    rule = cfg.straggler or STRAGGLER
    times = polls(T0 - rule.sustained - INTERVAL, rule.sustained)
    for i, now in enumerate(times):
        beats = [hb(r, now, phase=COMPUTE if (i + r) % 2 == 0 else COLLECTIVE,
                    step=10 - len(times) + i, in_phase=0.1, compute=0.2) for r in RANKS]
        assert detector.check(observe(now, beats)) is None
    return detector


def fire_window(factor: float, rule: StragglerDetection = STRAGGLER) -> tuple[float, float]:
    """Return when a lasting ``factor`` x straggler of :func:`straggling` may fire, from its
    first slow poll.

    Each poll it finishes one step with ``0.2 x (factor - 1)`` s more compute than the
    others, which the job loses (at most the poll's INTERVAL): the rule fires at the
    first poll at which that adds up to ``lost_seconds`` and MIN_SLOW_STEPS slow steps
    were seen, and by ``sustained`` at the latest.
    """
    if rule.lost_seconds is None:
        return rule.sustained, rule.sustained
    per_poll = min(0.2 * (factor - 1.0), INTERVAL)
    polls_needed = max(math.ceil(rule.lost_seconds / per_poll - 1e-9), MIN_SLOW_STEPS - 1)
    earliest = min(polls_needed * INTERVAL, rule.sustained)
    return earliest, earliest


NO_BUDGET = STRAGGLER.model_copy(update={"lost_seconds": None})


@pytest.mark.parametrize(("factor", "rule"), [
    pytest.param(40.0, STRAGGLER, id="40x"),
    pytest.param(3.0, STRAGGLER, id="3x"),
    pytest.param(2.0, STRAGGLER, id="2x"),
    pytest.param(1.6, STRAGGLER, id="1.6x"),
    pytest.param(40.0, NO_BUDGET, id="40x-lost_seconds-null"),
    pytest.param(1.6, NO_BUDGET, id="1.6x-lost_seconds-null"),
])
def test_straggler_fires_once_it_has_cost_lost_seconds_or_sustained(
    factor: float, rule: StragglerDetection
) -> None:
    detector = settled(CFG.model_copy(update={"straggler": rule}))
    found = first_fault(
        detector, polls(T0, 3 * rule.sustained), lambda now, i: straggling(now, i, {3: factor})
    )
    assert found is not None
    when, fault = found
    earliest, latest = fire_window(factor, rule)
    assert earliest - 1e-9 <= when - T0 <= latest + 1e-9
    assert_fault(fault, FaultKind.STRAGGLER, 3, "node-b", f"{factor:.1f}x",
                 f"sustained {rule.sustained:g}s")
    assert fault.evidence["ratio"] == factor
    assert fault.evidence["compute_seconds"][3] == pytest.approx(0.2 * factor)
    if when - T0 < rule.sustained:  # fired on its cost: the job had lost the budget
        assert rule.lost_seconds is not None
        assert fault.evidence["lost_seconds"] >= rule.lost_seconds - 1e-9
        assert f"lost_seconds {rule.lost_seconds:g}s" in fault.evidence["summary"]


def test_a_40x_straggler_fires_well_before_sustained_and_before_a_1_6x_one() -> None:
    fired = {}
    for factor in (40.0, 1.6):
        found = first_fault(settled(), polls(T0, 3 * STRAGGLER.sustained),
                            lambda now, i, f=factor: straggling(now, i, {3: f}))
        assert found is not None
        fired[factor] = found[0] - T0
    assert fired[40.0] <= STRAGGLER.sustained / 2 < fired[1.6] <= STRAGGLER.sustained


def test_the_same_ratio_costs_less_when_compute_is_a_small_part_of_the_step() -> None:
    """3x the others' compute, one step a poll: 0.2 s of compute costs the job 0.4 s a step,
    20 ms of compute (a step mostly spent in the collective) only 40 ms: called at sustained."""
    fired = {}
    for compute in (0.2, 0.02):
        def beats(now: float, i: int, compute: float = compute) -> list[Heartbeat]:
            return [hb(r, now, phase=COMPUTE if (i + r) % 2 == 0 else COLLECTIVE, step=10 + i,
                       in_phase=0.1, compute=compute * (3.0 if r == 3 else 1.0)) for r in RANKS]

        found = first_fault(settled(), polls(T0, 3 * STRAGGLER.sustained), beats)
        assert found is not None
        fired[compute] = found[0] - T0
        assert_fault(found[1], FaultKind.STRAGGLER, 3, "node-b", "3.0x")
    assert fired[0.2] == pytest.approx(fire_window(3.0)[0])
    assert fired[0.2] < STRAGGLER.sustained
    assert fired[0.02] == pytest.approx(STRAGGLER.sustained)


def test_a_slower_rank_takes_the_blame_from_a_mildly_slow_one() -> None:
    """Rank 0 runs 1.8x (background work) when rank 3 turns 40x: the job waits for rank 3."""
    detector = Detector(CFG)
    mild = polls(T0, fire_window(1.8)[0] - 2 * INTERVAL)  # rank 0: not yet due on its own
    for i, now in enumerate(mild):
        assert detector.check(observe(now, straggling(now, i, {0: 1.8}))) is None
    onset = mild[-1] + INTERVAL
    found = first_fault(
        detector, polls(onset, 3 * STRAGGLER.sustained),
        lambda now, i: straggling(now, i, {0: 1.8, 3: 40.0}),
    )
    assert found is not None
    _, fault = found
    assert_fault(fault, FaultKind.STRAGGLER, 3, "node-b", "40.0x")


def test_straggler_that_recovers_resets_the_clock() -> None:
    detector = Detector(CFG)
    almost = fire_window(2.0)[0] - INTERVAL
    slow = polls(T0, almost)
    for i, now in enumerate(slow):
        assert detector.check(observe(now, straggling(now, i, {3: 2.0}))) is None
    recovered = slow[-1] + INTERVAL
    assert detector.check(observe(recovered, straggling(recovered, 0, {}))) is None
    again = recovered + INTERVAL
    found = first_fault(
        detector, polls(again, 3 * STRAGGLER.sustained),
        lambda now, i: straggling(now, i, {3: 2.0}),
    )
    assert found is not None
    when, fault = found
    earliest, latest = fire_window(2.0)
    assert earliest - 1e-9 <= when - again <= latest + 1e-9, "the lost time starts again at 0"
    assert_fault(fault, FaultKind.STRAGGLER, 3, "node-b")


def test_a_stalled_jobs_frozen_figures_cost_nothing() -> None:
    """A 3x rank for a few steps, then every rank stops stepping (a hang on its way): the
    records still show 3x until the ranks drop out of the judged set, but no time is lost
    to a straggler while nobody steps, so the budget does not fill on stale figures."""
    slow_steps = MIN_SLOW_STEPS
    rising = fire_window(3.0)[0]
    assert (slow_steps - 1) * INTERVAL < rising, "not yet due when the steps stop"
    frozen_for = CFG.hang_timeout / 2  # how long a rank that stopped stepping is still judged
    found = first_fault(
        Detector(CFG), polls(T0, (slow_steps - 1) * INTERVAL + frozen_for),
        lambda now, i: straggling(now, min(i, slow_steps - 1), {3: 3.0}),
    )
    assert found is None, found[1].describe() if found else ""


def test_a_pause_in_stepping_is_not_counted_as_a_straggler_sustained() -> None:
    """A 1.6x rank (called at ``sustained`` only), then the whole job stops stepping for
    longer than ``sustained`` (a boundary waiting for its checkpoint to publish): on the
    first poll after it, the rank has not been slow for the pause as well. It is still
    called once it has been seen slow for ``sustained`` in all."""
    rule = NO_BUDGET
    detector = settled(CFG.model_copy(update={"straggler": rule}))
    before = polls(T0, rule.sustained - 2.0)
    for i, now in enumerate(before):
        assert detector.check(observe(now, straggling(now, i, {3: 1.6}))) is None
    last = len(before) - 1
    paused = polls(before[-1] + INTERVAL, 2 * rule.sustained)  # every record frozen
    for now in paused:  # judged while the frozen records are recent, then dropped
        assert detector.check(observe(now, straggling(now, last, {3: 1.6}))) is None
    back = paused[-1] + INTERVAL
    found = first_fault(detector, polls(back, rule.sustained),
                        lambda now, i: straggling(now, last + 1 + i, {3: 1.6}))
    assert found is not None, "a real straggler is still called"
    when, fault = found
    assert when > back, "called on the first poll after the pause: the pause was counted"
    assert_fault(fault, FaultKind.STRAGGLER, 3, "node-b", "1.6x")


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_single_jittery_steps_raise_no_straggler(seed: int) -> None:
    """Every rank's steps vary by 20%, and 1 record in 20 carries one step 2-6x as slow."""
    rng = random.Random(seed)

    def jittery(now: float, i: int) -> list[Heartbeat]:
        spikes = {r: rng.uniform(2.0, 6.0) if rng.random() < 0.05 else rng.uniform(0.8, 1.2)
                  for r in RANKS}
        return straggling(now, i, spikes)

    found = first_fault(Detector(CFG), polls(T0, 120.0), jittery)
    assert found is None, found[1].describe() if found else ""


@pytest.mark.parametrize("lag_polls", [0, 1], ids=["together", "one-poll-apart"])
def test_every_rank_slowing_down_at_once_is_throughput_not_a_straggler(lag_polls: int) -> None:
    assert THROUGHPUT is not None
    detector = Detector(CFG)
    slow_from = THROUGHPUT.warmup_steps + int(THROUGHPUT.baseline / INTERVAL) + 4
    fault = None
    for i, now in enumerate(polls(T0, 60.0)):
        factor = {r: 3.0 if i >= slow_from + (lag_polls if r else 0) else 1.0 for r in RANKS}
        beats = straggling(now, i, factor)
        for b in beats:
            b.samples_per_second = 1000.0 / max(factor.values())
        fault = detector.check(observe(now, beats))
        if fault is not None:
            break
    assert fault is not None and fault.kind is FaultKind.THROUGHPUT_DEGRADED, (
        fault.describe() if fault else "no fault")


@pytest.mark.parametrize(
    ("cfg", "factor"),
    [
        pytest.param(CFG, STRAGGLER.ratio * 0.99, id="just-below-ratio"),
        pytest.param(CFG.model_copy(update={"straggler": None}), 3.0, id="rule-off"),
    ],
)
def test_straggler_never_fires(cfg: Detection, factor: float) -> None:
    detector = Detector(cfg)
    found = first_fault(
        detector, polls(T0, 4 * STRAGGLER.sustained),
        lambda now, i: straggling(now, i, {3: factor}),
    )
    assert found is None, found[1].describe() if found else ""


# -- throughput --------------------------------------------------------------------


class Job:
    """Drive one detector through a job's polls with a chosen samples/s."""

    def __init__(self, cfg: Detection = CFG) -> None:
        self.detector = Detector(cfg)
        self.now = T0
        self.step = 100

    def poll(self, rate: float) -> Fault | None:
        self.now += INTERVAL
        self.step += 1
        beats = [
            hb(r, self.now, phase=COMPUTE if (self.step + r) % 2 else COLLECTIVE,
               step=self.step, sps=rate * (1.0 + 0.001 * r))
            for r in RANKS
        ]
        return self.detector.check(observe(self.now, beats))

    def warm_up_and_measure(self, rates: tuple[float, ...] = (990.0, 1000.0, 1010.0)) -> None:
        """Run warm-up (slow, must not count) and the baseline window."""
        assert THROUGHPUT is not None
        for _ in range(THROUGHPUT.warmup_steps):
            assert self.poll(200.0) is None
            assert self.detector.baseline is None
        measured_from = self.now + INTERVAL
        i = 0
        while self.detector.baseline is None:
            assert self.poll(rates[i % len(rates)]) is None
            i += 1
            assert self.now - measured_from <= THROUGHPUT.baseline + INTERVAL, "no baseline"
        assert self.now - measured_from >= THROUGHPUT.baseline


def test_throughput_degraded_only_once_sustained_below_the_floor() -> None:
    job = Job()
    job.warm_up_and_measure()
    assert job.detector.baseline == pytest.approx(1000.0)
    assert 500.0 < THROUGHPUT.floor * 1000.0 < 1000.0, "500 samples/s is below the floor"

    started = job.now + INTERVAL
    fault = None
    while fault is None:
        fault = job.poll(500.0)
        assert job.now - started <= THROUGHPUT.sustained, "never reported"
    assert job.now - started == pytest.approx(THROUGHPUT.sustained)
    assert_fault(
        fault, FaultKind.THROUGHPUT_DEGRADED, None, None,
        "500 samples/s", "baseline 1000", f"sustained {THROUGHPUT.sustained:g}s",
    )
    assert fault.evidence["baseline"] == pytest.approx(1000.0)
    assert fault.evidence["samples_per_second"] == pytest.approx(500.0)


def test_throughput_dips_that_recover_before_sustained_are_ignored() -> None:
    job = Job()
    job.warm_up_and_measure()
    short = int(THROUGHPUT.sustained / INTERVAL)  # held reaches sustained - INTERVAL at most
    for _ in range(3):
        for _ in range(short):
            assert job.poll(500.0) is None
        assert job.poll(1000.0) is None
    for _ in range(3 * short):
        assert job.poll(THROUGHPUT.floor * 1000.0 * 1.02) is None  # just above the floor


def test_throughput_rule_off() -> None:
    job = Job(CFG.model_copy(update={"throughput": None}))
    for _ in range(THROUGHPUT.warmup_steps + 4 * int(THROUGHPUT.baseline / INTERVAL)):
        assert job.poll(1000.0) is None
    for _ in range(4 * int(THROUGHPUT.sustained / INTERVAL)):
        assert job.poll(10.0) is None


# -- nan loss ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "rank", "mention"),
    [
        pytest.param({2: (7, math.nan)}, 2, "nan", id="one-nan"),
        pytest.param({1: (7, math.inf)}, 1, "inf", id="one-inf"),
        pytest.param({3: (7, -math.inf)}, 3, "-inf", id="minus-inf"),
        pytest.param({2: (7, math.nan), 3: (6, math.inf)}, 3, "inf", id="lowest-step-wins"),
        pytest.param({3: (7, math.nan), 1: (7, math.nan)}, 1, "nan", id="then-lowest-rank"),
    ],
)
def test_non_finite_loss(bad: dict[int, tuple[int, float]], rank: int, mention: str) -> None:
    beats = [
        hb(r, T0, phase=COLLECTIVE, step=bad.get(r, (8, 0.0))[0], loss=bad.get(r, (8, 1.5))[1])
        for r in RANKS
    ]
    step = bad[rank][0]
    fault = assert_fault(
        check(observe(T0, beats)), FaultKind.NAN_LOSS, rank, NODE_OF[rank],
        f"loss became {mention}", f"step {step}",
    )
    assert fault.evidence["step"] == step
    assert fault.evidence["ranks"] == sorted(bad)


def test_nan_culprit_is_the_rank_whose_loss_went_first_not_the_one_behind() -> None:
    # The all-reduce spreads rank 2's NaN to every rank one step later; by the time
    # the watcher reads, rank 1 may be a step behind the rest. The first bad step counts.
    beats = [hb(r, T0, phase=COLLECTIVE, step=33, loss=math.nan) for r in (0, 3)]
    beats.append(hb(1, T0, phase=COLLECTIVE, step=32, loss=math.nan))
    beats.append(hb(2, T0, phase=COLLECTIVE, step=33, loss=math.nan))
    for beat in beats:
        beat.nonfinite_step = 31 if beat.rank == 2 else 32
    fault = assert_fault(check(observe(T0, beats)), FaultKind.NAN_LOSS, 2, NODE_OF[2], "step 31")
    assert fault.evidence["step"] == 31


def test_nonfinite_step_is_recorded_once_by_the_writer(tmp_path: Path) -> None:
    writer = HeartbeatWriter(tmp_path, 0, "node-a", 0.5)
    writer.beat(step=4, loss=2.0)
    writer.beat(step=5, loss=math.inf)
    writer.beat(step=6, loss=math.nan)
    writer.flush_now()
    assert read_heartbeats(tmp_path)[0].nonfinite_step == 5


def test_nan_loss_rule_off() -> None:
    beats = [hb(r, T0, phase=COLLECTIVE, loss=math.nan) for r in RANKS]
    assert check(observe(T0, beats), CFG.model_copy(update={"nan_loss": False})) is None


def test_missing_loss_is_not_nan() -> None:
    beats = [hb(r, T0, phase=COLLECTIVE, loss=None) for r in RANKS]
    assert check(observe(T0, beats)) is None


# -- launch failure ------------------------------------------------------------------


PAST_STARTUP = CFG.startup_timeout + 1.0


@pytest.mark.parametrize(
    ("waited", "beats", "culprit", "mention"),
    [
        pytest.param(
            PAST_STARTUP, lambda now: [hb(r, now, phase=STARTING) for r in (1, 2, 3)],
            0, "no heartbeat", id="rank-0-never-wrote",
        ),
        pytest.param(
            PAST_STARTUP,
            lambda now: [hb(r, now, phase=COLLECTIVE) for r in (0, 1, 3)]
            + [hb(2, now, phase=STARTING, in_phase=PAST_STARTUP)],
            2, "still starting", id="rank-2-still-starting",
        ),
        pytest.param(
            CFG.startup_timeout, lambda now: [hb(r, now, phase=STARTING) for r in (1, 2, 3)],
            None, "", id="at-the-timeout",
        ),
        pytest.param(
            CFG.startup_timeout / 2, lambda now: [hb(r, now, phase=STARTING) for r in (1, 2)],
            None, "", id="before-the-timeout",
        ),
    ],
)
def test_startup(
    waited: float, beats: Callable[[float], list[Heartbeat]], culprit: int | None, mention: str
) -> None:
    now = LAUNCHED + waited
    fault = check(observe(now, beats(now)))
    if culprit is None:
        assert fault is None
        return
    fault = assert_fault(
        fault, FaultKind.LAUNCH_FAILURE, culprit, NODE_OF[culprit],
        mention, f"{waited:.1f}s after launch", f"startup_timeout {CFG.startup_timeout:g}s",
    )
    assert fault.evidence["missing_ranks"] == [r for r in RANKS if r not in
                                               {b.rank for b in beats(now)}]


# -- crash -------------------------------------------------------------------------


def failed(now: float) -> LaunchStatus:
    """Rank 1 was SIGKILLed; its peers went down with SIGTERM or "connection reset"."""
    return LaunchStatus(
        AttemptState.FAILED,
        {
            "node-a": NodeStatus("node-a", NodeState.FAILED, {1: -9, 0: -15}, last_seen=now),
            "node-b": NodeStatus("node-b", NodeState.FAILED, {2: 1, 3: 1}, last_seen=now),
        },
    )


def test_crash_names_the_killed_rank() -> None:
    beats = [hb(r, T0, phase=COLLECTIVE, step=6 + r) for r in RANKS]
    fault = assert_fault(
        check(observe(T0, beats, launch=failed(T0))), FaultKind.CRASH, 1, "node-a",
        "rank 1 exited with code -9",
    )
    assert fault.evidence["exit_codes"] == {1: -9, 0: -15, 2: 1, 3: 1}


def peers_first() -> LaunchStatus:
    """node-b's ranks died of "connection reset"; node-a's agent has not reported rank 1 yet."""
    return LaunchStatus(AttemptState.FAILED, {
        "node-a": NodeStatus("node-a", NodeState.RUNNING, {0: None, 1: None}, last_seen=T0),
        "node-b": NodeStatus("node-b", NodeState.FAILED, {2: 1, 3: 1}, last_seen=T0),
    })


def test_peers_reporting_first_do_not_get_the_blame() -> None:
    beats = [hb(r, T0, phase=COLLECTIVE, step=6) for r in RANKS]
    early = peers_first()
    detector = Detector(CFG)
    assert detector.check(observe(T0, beats, launch=early)) is None
    assert detector.check(observe(T0 + 0.5, beats, launch=early)) is None
    assert_fault(detector.check(observe(T0 + 1.0, beats, launch=failed(T0 + 1.0))),
                 FaultKind.CRASH, 1, "node-a", "rank 1 exited with code -9")


def test_peers_get_the_blame_when_nobody_else_ever_reports() -> None:
    beats = [hb(r, T0, phase=COLLECTIVE, step=6) for r in RANKS]
    early = peers_first()
    detector = Detector(CFG)
    assert detector.check(observe(T0, beats, launch=early)) is None
    assert_fault(detector.check(observe(T0 + 2.5, beats, launch=early)),
                 FaultKind.CRASH, 2, "node-b", "rank 2 exited with code 1")


@pytest.mark.parametrize("culprit_beat", [None, STARTING], ids=["no-heartbeat", "starting"])
def test_crash_before_first_step_is_a_launch_failure(culprit_beat: str | None) -> None:
    beats = [hb(r, T0, phase=COLLECTIVE, step=6) for r in (0, 2, 3)]
    if culprit_beat is not None:
        beats.append(hb(1, T0, phase=culprit_beat, step=0))
    fault = assert_fault(
        check(observe(T0, beats, launch=failed(T0))), FaultKind.LAUNCH_FAILURE, 1, "node-a",
        "before its first step", "-9",
    )
    assert fault.evidence["exit_codes"] == {1: -9, 0: -15, 2: 1, 3: 1}
    assert fault.detected_at == T0


def test_crash_detected_at_is_the_observation_time() -> None:
    beats = [hb(r, T0, phase=COLLECTIVE, step=6) for r in RANKS]
    fault = check(observe(T0, beats, launch=failed(T0)))
    assert fault is not None and fault.kind is FaultKind.CRASH
    assert fault.detected_at == T0


# -- rule order ----------------------------------------------------------------------


def test_crash_wins_over_a_stale_heartbeat() -> None:
    beats = [hb(r, T0, phase=COLLECTIVE, step=6) for r in (0, 2, 3)] + [
        hb(1, T0, step=6, age=CFG.heartbeat_timeout + 3.0, in_phase=CFG.heartbeat_timeout + 3.0)
    ]
    assert check(observe(T0, beats)).kind is FaultKind.RANK_UNRESPONSIVE  # type: ignore[union-attr]
    assert_fault(
        check(observe(T0, beats, launch=failed(T0))), FaultKind.CRASH, 1, "node-a", "-9"
    )


def test_nan_wins_over_straggler() -> None:
    cfg = CFG.model_copy(update={"straggler": NO_BUDGET})  # fires at sustained, exactly
    plain, poisoned = settled(cfg), settled(cfg)
    times = polls(T0, STRAGGLER.sustained)
    for i, now in enumerate(times[:-1]):
        for detector in (plain, poisoned):
            assert detector.check(observe(now, straggling(now, i, {3: 2.0}))) is None
    now, i = times[-1], len(times) - 1
    beats = straggling(now, i, {3: 2.0})
    assert_fault(plain.check(observe(now, beats)), FaultKind.STRAGGLER, 3, "node-b")
    beats[0].loss = math.nan
    assert_fault(poisoned.check(observe(now, beats)), FaultKind.NAN_LOSS, 0, "node-a", "nan")


# -- enabled kinds -----------------------------------------------------------------


def hung(now: float) -> list[Heartbeat]:
    stuck = CFG.hang_timeout + 1.0
    return [hb(1, now, in_phase=stuck)] + [
        hb(r, now, phase=COLLECTIVE, in_phase=stuck) for r in (0, 2, 3)
    ]


def test_detector_enabled_for_throughput_only_ignores_a_hang() -> None:
    assert check(observe(T0, hung(T0))) is not None
    detector = Detector(CFG, frozenset({FaultKind.THROUGHPUT_DEGRADED}))
    assert detector.check(observe(T0, hung(T0))) is None


def test_detector_enabled_for_rank_unresponsive_reports_a_stale_rank() -> None:
    detector = Detector(CFG, frozenset({FaultKind.RANK_UNRESPONSIVE}))
    assert_fault(
        detector.check(observe(T0, node_b_silent(T0))), FaultKind.RANK_UNRESPONSIVE, 3, "node-b"
    )
    assert detector.check(observe(T0, hung(T0))) is None


def test_a_node_is_unresponsive_once_its_ranks_and_agent_are_silent_heartbeat_timeout() -> None:
    # Frozen just over heartbeat_timeout ago: the agent's last answer (a poll) and the
    # ranks' last beats all came just before the freeze. No extra wait for the agent.
    beats = [hb(r, T0, phase=COLLECTIVE) for r in (0, 1)]
    beats += [hb(2, T0, age=CFG.heartbeat_timeout + 0.2),
              hb(3, T0, age=CFG.heartbeat_timeout + 0.05)]
    launch = running(T0, agent_age={"node-b": CFG.heartbeat_timeout + 0.05})
    assert_fault(check(observe(T0, beats, launch=launch)), FaultKind.NODE_UNRESPONSIVE, None,
                 "node-b")
    # An agent that answered within heartbeat_timeout is not silent yet: look again.
    launch = running(T0, agent_age={"node-b": CFG.heartbeat_timeout - 0.05})
    assert check(observe(T0, beats, launch=launch)) is None


def test_detector_enabled_for_rank_unresponsive_never_reports_a_node() -> None:
    detector = Detector(CFG, frozenset({FaultKind.RANK_UNRESPONSIVE}))
    fault = detector.check(observe(T0, node_b_silent(T0), launch=None))
    assert fault is None or fault.kind is FaultKind.RANK_UNRESPONSIVE


def test_detector_enabled_for_rank_unresponsive_still_reports_ranks_of_a_silent_node() -> None:
    detector = Detector(CFG, frozenset({FaultKind.RANK_UNRESPONSIVE}))
    later = T0 + AGENT_STATUS_INTERVAL_SECONDS + 2 * INTERVAL  # past the grace for a node
    fault = detector.check(observe(later, node_b_silent(T0), launch=None))
    assert_fault(fault, FaultKind.RANK_UNRESPONSIVE, 3, "node-b")


def test_detector_enabled_for_node_only_ignores_a_single_stale_rank() -> None:
    detector = Detector(CFG, frozenset({FaultKind.NODE_UNRESPONSIVE}))
    assert detector.check(observe(T0, node_b_silent(T0))) is None
    assert_fault(
        detector.check(observe(T0, node_b_silent(T0), launch=None)),
        FaultKind.NODE_UNRESPONSIVE, None, "node-b",
    )


# -- Fault ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        Fault(FaultKind.HANG, 1, "node-a",
              {"summary": "rank 1 stalled", "seconds_in_phase": {0: 3.4, 1: 3.5}}, T0),
        Fault(FaultKind.THROUGHPUT_DEGRADED, None, None, {"summary": "slow"}, T0),
        Fault(FaultKind.NODE_UNRESPONSIVE, None, "node-b", {}, T0),
    ],
    ids=["rank", "job-wide", "node-no-summary"],
)
def test_fault_event_round_trip(fault: Fault) -> None:
    event = fault.to_event()
    assert event["status"] == "faulted"
    assert event["fault"]["kind"] == fault.kind.value
    assert type(event["fault"]["kind"]) is str
    again = Fault.from_event(event["fault"])
    assert again == fault
    assert again.kind is fault.kind


def test_detected_fault_round_trips() -> None:
    fault = check(observe(T0, hung(T0)))
    assert fault is not None
    assert Fault.from_event(fault.to_event()["fault"]) == fault


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (Fault(FaultKind.HANG, 1, "node-a", {"summary": "stalled"}, T0),
         "hang (node node-a, rank 1): stalled"),
        (Fault(FaultKind.NODE_UNRESPONSIVE, None, "node-b", {"summary": "silent"}, T0),
         "node_unresponsive (node node-b): silent"),
        (Fault(FaultKind.THROUGHPUT_DEGRADED, None, None, {"summary": "slow"}, T0),
         "throughput_degraded (job-wide): slow"),
        (Fault(FaultKind.NAN_LOSS, 2, None, {}, T0), "nan_loss (rank 2)"),
    ],
)
def test_describe_names_kind_and_culprit(fault: Fault, expected: str) -> None:
    assert fault.describe() == expected


def test_median_without_equals_the_median_of_the_others() -> None:
    from relay.watch.slowness import median_without as _median_without

    rng = random.Random(7)
    for n in range(2, 14):
        for _ in range(100):
            values = sorted(rng.choice([0.1, 0.2, 0.3, rng.random()]) for _ in range(n))
            left_out = rng.choice(values)
            others = list(values)
            others.remove(left_out)
            assert _median_without(values, left_out) == pytest.approx(statistics.median(others))


def test_a_freezing_node_is_not_blamed_on_its_first_silent_rank() -> None:
    # Frozen at T0 - 2.2: rank 2 last wrote 0.3 s before that, rank 3 just before the
    # freeze, the agent 0.1 s before it. At T0 only rank 2 is stale, and the agent's last
    # word came before rank 2 could have been missed: wait rather than blame rank 2.
    beats = [hb(r, T0, phase=COLLECTIVE) for r in (0, 1)]
    beats += [
        hb(2, T0, age=CFG.heartbeat_timeout + 0.3),
        hb(3, T0, age=CFG.heartbeat_timeout - 0.1),
    ]
    launch = running(T0, agent_age={"node-b": CFG.heartbeat_timeout + 0.1})
    assert check(observe(T0, beats, launch=launch)) is None
    # Once every rank and the agent are silent long enough, it is the node.
    later = T0 + AGENT_STATUS_INTERVAL_SECONDS + 0.5
    assert_fault(check(observe(later, beats, launch=launch)), FaultKind.NODE_UNRESPONSIVE, None,
                 "node-b")


def test_a_node_frozen_before_the_watcher_started_is_node_unresponsive() -> None:
    """A watcher that adopts a running workload never hears a node frozen before it came.

    Its ranks are missing, not stale, and its agent never answered: the node is silent,
    not every rank "busy" (the job-wide hang rule needs every rank heard).
    """
    detector = Detector(CFG)
    alive = running(T0, agent_age={"node-a": None})
    hung_since = CFG.hang_timeout + 1.0  # node-b waits on node-a in the collective
    beats = [hb(r, T0, phase=COLLECTIVE, in_phase=hung_since) for r in (2, 3)]
    assert detector.check(observe(T0, beats, launch=alive)) is None  # just started watching
    later = T0 + CFG.heartbeat_timeout + AGENT_STATUS_INTERVAL_SECONDS + INTERVAL
    beats = [hb(r, later, phase=COLLECTIVE, in_phase=hung_since + later - T0) for r in (2, 3)]
    fault = detector.check(observe(later, beats, launch=running(later, agent_age={"node-a": None})))
    fault = assert_fault(fault, FaultKind.NODE_UNRESPONSIVE, None, "node-a")
    assert fault.evidence["heartbeat_age_seconds"] == {0: None, 1: None}
    assert fault.evidence["agent_age_seconds"] is None


def test_unheard_ranks_of_a_node_whose_agent_answers_are_no_node_fault() -> None:
    detector = Detector(CFG)
    beats = [hb(r, T0) for r in (2, 3)]
    assert detector.check(observe(T0, beats, launched_at=T0 - 1)) is None
    later = T0 + CFG.heartbeat_timeout + AGENT_STATUS_INTERVAL_SECONDS + INTERVAL
    assert detector.check(observe(later, [hb(r, later) for r in (2, 3)], launched_at=T0 - 1)) \
        is None  # their heartbeats may be late; past startup_timeout: a launch failure
    fault = detector.check(observe(later, [hb(r, later) for r in (2, 3)]))
    assert_fault(fault, FaultKind.LAUNCH_FAILURE, 0, "node-a", "no heartbeat")


def test_policy_explain_says_what_a_straggler_costs_before_it_is_called_one() -> None:
    from relay.policy.explain import fault_sentence, humanize

    assert STRAGGLER.lost_seconds is not None
    budget = fault_sentence(FaultKind.STRAGGLER, CFG)
    assert f"lose {humanize(STRAGGLER.lost_seconds)} waiting for it" in budget
    assert "the slower the rank, the sooner" in budget
    assert f"at least {MIN_SLOW_STEPS} slow steps" in budget
    assert f"{humanize(STRAGGLER.sustained)} at most" in budget
    plain = fault_sentence(FaultKind.STRAGGLER, CFG.model_copy(update={"straggler": NO_BUDGET}))
    assert "lose" not in plain and f"for {humanize(STRAGGLER.sustained)}" in plain


def test_no_straggler_is_called_while_the_ranks_start_stepping() -> None:
    """Rank 0 at 1.6x from the first step (its MLflow client, its first upload): nothing
    for ``sustained``, as the ranks settle; called on cost once that has passed."""
    detector = Detector(CFG)
    found = first_fault(detector, polls(T0, 3 * STRAGGLER.sustained),
                        lambda now, i: straggling(now, i, {0: 1.6}))
    assert found is not None
    when, fault = found
    assert when - T0 >= STRAGGLER.sustained + fire_window(1.6)[0] - INTERVAL
    assert_fault(fault, FaultKind.STRAGGLER, 0, "node-a", "1.6x")


def test_an_adopted_workload_is_judged_from_the_first_poll() -> None:
    """A watcher that adopted a workload at a segment boundary (``settled``): its ranks
    have stepped for a whole segment, so a straggler is called on cost at once, not
    ``sustained`` later as in a fresh workload's start-up."""
    found = first_fault(Detector(CFG, settled=True), polls(T0, 3 * STRAGGLER.sustained),
                        lambda now, i: straggling(now, i, {3: 3.0}))
    assert found is not None
    assert found[0] - T0 <= fire_window(3.0)[1] + 1e-9 < STRAGGLER.sustained
    assert_fault(found[1], FaultKind.STRAGGLER, 3, "node-b", "3.0x")


def test_a_straggler_on_its_way_is_suspected_before_it_is_called() -> None:
    detector = settled()
    times = polls(T0, STRAGGLER.sustained)
    suspected: tuple[float, str] | None = None
    for i, now in enumerate(times):
        obs = observe(now, straggling(now, i, {3: 1.6}))
        if detector.check(obs) is not None:
            break
        why = detector.suspects(obs)
        suspected = suspected or ((now, why) if why else None)
    assert suspected is not None and suspected[0] - T0 < fire_window(1.6)[0]
    assert suspected[1] == "rank 3 half way to a straggler (over 1.5x the others' compute)"


def test_a_blip_of_two_slow_steps_is_not_suspected() -> None:
    """A rank over the ratio for two steps (a moment of contention on a shared host), then
    back to its pace: no suspicion, so no spare is preloaded beside the training."""
    detector = settled()
    for i, now in enumerate(polls(T0, STRAGGLER.sustained)):
        obs = observe(now, straggling(now, i, {3: 3.0} if i < 2 else {}))
        assert detector.check(obs) is None
        assert detector.suspects(obs) is None


# -- when the watcher should look again -----------------------------------------------


def test_due_at_is_when_a_stalled_rank_would_be_called_a_hang() -> None:
    # Rank 1 in compute for 1.5 s while the others wait: due once it has been hang_timeout
    # (before any heartbeat, fresh at T0, could go stale).
    stuck = T0 - 1.5
    beats = [hb(1, T0, in_phase=1.5)] + [hb(r, T0, phase=COLLECTIVE) for r in (0, 2, 3)]
    detector = Detector(CFG)
    assert detector.check(observe(T0, beats)) is None
    due = detector.due_at(observe(T0, beats))
    assert due == pytest.approx(stuck + CFG.hang_timeout)
    later = due + 0.01
    fault = detector.check(observe(later, [hb(1, later, in_phase=later - stuck)] + [
        hb(r, later, phase=COLLECTIVE) for r in (0, 2, 3)]))
    assert_fault(fault, FaultKind.HANG, 1, "node-a")


def test_due_at_is_when_the_oldest_silence_reaches_heartbeat_timeout() -> None:
    # Node-b (ranks and agent) went quiet 1.5 s ago, the rest is fresh.
    beats = [hb(r, T0, phase=COLLECTIVE) for r in (0, 1)] + [
        hb(2, T0, age=1.5), hb(3, T0, age=1.4)]
    obs = observe(T0, beats, launch=running(T0, agent_age={"node-b": 1.45}))
    assert check(obs) is None
    assert Detector(CFG).due_at(obs) == pytest.approx(T0 - 1.5 + CFG.heartbeat_timeout)


def test_due_at_of_a_healthy_job_is_past_the_next_poll() -> None:
    """Fresh heartbeats and answers put every threshold seconds away: no extra looks."""
    beats = [hb(r, T0, age=INTERVAL) for r in (0, 1)] + [
        hb(r, T0, phase=COLLECTIVE, age=INTERVAL) for r in (2, 3)]
    due = Detector(CFG).due_at(observe(T0, beats))
    assert due is not None and due - T0 > CFG.poll_interval


def test_due_at_leaves_out_kinds_the_watcher_does_not_report() -> None:
    beats = [hb(1, T0, in_phase=1.0)] + [hb(r, T0, phase=COLLECTIVE) for r in (0, 2, 3)]
    assert Detector(CFG, frozenset({FaultKind.STRAGGLER})).due_at(observe(T0, beats)) is None
