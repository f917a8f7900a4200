"""A slow link names its node (relay.watch.slow_link): the watcher's status round trip to each
node's agent, judged when the job's throughput falls."""

from __future__ import annotations

import pytest

from relay.core.attempt import AttemptState
from relay.core.faults import Fault, FaultKind
from relay.core.settings import REPO_ROOT
from relay.launchers.base import LaunchStatus, NodeStatus
from relay.policy.decide import decide
from relay.policy.model import Detection, load_policy
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay.watch.slow_link import MIN_EXTRA_SECONDS, MIN_SAMPLES, RATIO, WINDOW, LinkWatch
from relay_train.protocol.heartbeat import Heartbeat, Phase
from relay_train.protocol.routes import NodeState

NODES = ["node1", "node2", "node3"]
INTERVAL = 0.5
T0 = 1_700_000_000.0
HEALTHY = 0.01  # seconds: a healthy round trip on the test bed (measured 5-20 ms)
THROUGHPUT = Fault(FaultKind.THROUGHPUT_DEGRADED, None, None,
                   {"summary": "job throughput 40 samples/s is 7% of its baseline 600"}, T0)


def observation(now: float, trips: dict[str, float | None], step: int = 0,
                rate: float | None = None, seen: float | None = None) -> Observation:
    """Return a snapshot at ``now``: node i runs rank i, its agent answered at ``seen``
    (default ``now``) after ``trips[node]`` s; each rank at ``step`` doing ``rate`` samples/s."""
    nodes = {n: NodeStatus(n, NodeState.RUNNING, {i: None}, last_seen=now if seen is None
                           else seen, round_trip=trips.get(n)) for i, n in enumerate(NODES)}
    beats = {i: Heartbeat(rank=i, node=n, pid=1000 + i, step=step,
                          phase=Phase.COMPUTE.value if step % 2 else Phase.COLLECTIVE.value,
                          phase_started_at=now - 0.1, compute_seconds=0.01,
                          samples_per_second=rate, wall_clock=now - 0.05, seq=step)
             for i, n in enumerate(NODES)}
    return Observation(now=now, launched_at=T0 - 300.0, heartbeats=beats,
                       node_ranks={n: [i] for i, n in enumerate(NODES)},
                       heartbeat_interval=INTERVAL,
                       launch=LaunchStatus(AttemptState.RUNNING, nodes, beats))


def watched(rounds: list[dict[str, float | None]]) -> LinkWatch:
    links = LinkWatch()
    for i, trips in enumerate(rounds):
        links.observe(observation(T0 + i * INTERVAL, trips))
    return links


def test_the_node_whose_round_trip_stands_out_is_named() -> None:
    slow = {"node1": HEALTHY, "node2": 0.005, "node3": 0.21}  # tbf rate 1mbit on node3
    links = watched([slow] * WINDOW)
    found = links.slow_node()
    assert found is not None and found[0] == "node3", found
    fault = links.attribute(THROUGHPUT)
    assert (fault.kind, fault.culprit_node, fault.culprit_rank) == (
        FaultKind.STRAGGLER, "node3", None)
    assert "node3's link is slow" in fault.evidence["summary"]
    assert "7% of its baseline" in fault.evidence["summary"]  # the throughput's figures kept
    assert fault.evidence["link_round_trip_seconds"]["node3"] == pytest.approx(0.21)
    assert fault.detected_at == THROUGHPUT.detected_at


@pytest.mark.parametrize("trips", [
    {"node1": HEALTHY, "node2": HEALTHY, "node3": HEALTHY},  # every link alike: the job's own
    {"node1": 0.2, "node2": 0.25, "node3": 0.3},  # every node late: the watcher's host is loaded
    # RATIO x the others but not MIN_EXTRA_SECONDS more: a few ms under load
    {"node1": 0.004, "node2": 0.004, "node3": 0.004 + MIN_EXTRA_SECONDS * 0.9},
    # MIN_EXTRA_SECONDS more but not RATIO x the others
    {"node1": 0.1, "node2": 0.1, "node3": 0.1 * RATIO * 0.9},
])
def test_no_link_stands_out_and_the_throughput_fault_stays_job_wide(
        trips: dict[str, float]) -> None:
    links = watched([trips] * WINDOW)
    assert links.slow_node() is None
    assert links.attribute(THROUGHPUT) is THROUGHPUT


def test_a_few_late_answers_under_load_are_not_a_slow_link() -> None:
    """The median judges: single answers of 0.23 s were measured on healthy nodes."""
    rounds = [{"node1": HEALTHY, "node2": HEALTHY, "node3": HEALTHY} for _ in range(WINDOW)]
    for i in (1, 4, 6):  # under half of the window
        rounds[i]["node3"] = 0.8
    assert watched(rounds).slow_node() is None


def test_an_answer_is_counted_once_and_too_few_are_not_judged() -> None:
    links = LinkWatch()
    slow = {"node1": HEALTHY, "node2": HEALTHY, "node3": 0.5}
    for i in range(3 * WINDOW):  # the same answer, reused by every poll
        links.observe(observation(T0 + i * INTERVAL, slow, seen=T0))
    assert links.slow_node() is None, f"one answer is not {MIN_SAMPLES}"
    for i in range(1, MIN_SAMPLES):
        links.observe(observation(T0 + i * INTERVAL, slow))
    assert links.slow_node() is not None


def test_other_faults_and_unmeasured_round_trips_are_left_alone() -> None:
    links = watched([{"node1": HEALTHY, "node2": HEALTHY, "node3": 0.3}] * WINDOW)
    hang = Fault(FaultKind.HANG, 1, "node2", {"summary": "stuck"}, T0)
    assert links.attribute(hang) is hang
    assert watched([{"node1": None, "node2": None, "node3": None}] * WINDOW).slow_node() is None


def run_job(detector: Detector, slow_link: bool) -> Fault | None:
    """Drive ``detector`` through a job: warm-up and baseline at 600 samples/s, then 40
    (node3's link rate-limited, when ``slow_link``; else the job's own slowdown)."""
    assert detector.cfg.throughput is not None
    now, step = T0, 0
    healthy = {"node1": HEALTHY, "node2": HEALTHY, "node3": HEALTHY}
    while detector.baseline is None:
        now, step = now + INTERVAL, step + 1
        assert detector.check(observation(now, healthy, step, 600.0)) is None
        assert now - T0 < 60, "no baseline"
    late = {**healthy, "node3": 0.21} if slow_link else healthy
    for _ in range(int(detector.cfg.throughput.sustained / INTERVAL) + 4):
        now, step = now + INTERVAL, step + 1
        fault = detector.check(observation(now, late, step, 40.0))
        if fault is not None:
            return fault
    return None


def test_the_detector_calls_a_slow_links_throughput_fault_a_straggler_of_its_node() -> None:
    fault = run_job(Detector(Detection()), slow_link=True)
    assert fault is not None and (fault.kind, fault.culprit_node) == (
        FaultKind.STRAGGLER, "node3"), fault
    # The default policy: move off node3 and quarantine it, as for a straggler.
    policy = load_policy(REPO_ROOT / "policies" / "default.yaml")
    decision = decide(fault, [], policy.policy, policy.sha256)
    assert (decision.action, decision.quarantine_node) == ("checkpoint_and_migrate", "node3")


def test_the_detector_keeps_a_job_wide_slowdown_job_wide() -> None:
    fault = run_job(Detector(Detection()), slow_link=False)
    assert fault is not None and (fault.kind, fault.culprit_node) == (
        FaultKind.THROUGHPUT_DEGRADED, None), fault


def test_with_stragglers_not_reported_the_throughput_fault_stays() -> None:
    kinds = frozenset(FaultKind) - {FaultKind.STRAGGLER}
    fault = run_job(Detector(Detection(), enabled=kinds), slow_link=True)
    assert fault is not None and fault.kind is FaultKind.THROUGHPUT_DEGRADED, fault
