"""A preemption notice, from an agent's status record to a ``preempted`` fault."""

from __future__ import annotations

import pytest

from relay.core.attempt import AttemptState
from relay.core.faults import FaultKind
from relay.launchers.base import LaunchStatus, NodeStatus, Notice, notice_of
from relay.policy.model import Detection
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay_train.protocol.routes import (
    AGE_SECONDS,
    DRAIN_SECONDS,
    GRACE_SECONDS,
    PREEMPTED,
    NodeState,
)

NOW = 1_700_000_000.0
NODE_RANKS = {"node-a": [0, 1], "node-b": [2, 3]}


def _record(grace: float = 30.0, drain: float = 24.0, age: float = 2.0) -> dict[str, object]:
    return {PREEMPTED: {GRACE_SECONDS: grace, DRAIN_SECONDS: drain, AGE_SECONDS: age}}


def test_a_notice_is_placed_on_relays_clock_by_its_age() -> None:
    notice = notice_of(_record(), received_at=NOW)
    assert notice == Notice(grace_seconds=30.0, drain_by=NOW - 2.0 + 24.0)


@pytest.mark.parametrize("record", [
    {}, {PREEMPTED: None}, {PREEMPTED: "soon"}, {PREEMPTED: {GRACE_SECONDS: 30.0}},
    {PREEMPTED: {GRACE_SECONDS: "x", AGE_SECONDS: 1.0}},
    {PREEMPTED: {GRACE_SECONDS: -1.0, AGE_SECONDS: 1.0}},
    {PREEMPTED: {GRACE_SECONDS: float("nan"), AGE_SECONDS: 1.0}},
])
def test_no_notice_or_a_malformed_one_is_none(record: dict[str, object]) -> None:
    assert notice_of(record, received_at=NOW) is None


def _status(notice: Notice | None, b_state: NodeState = NodeState.RUNNING,
            b_codes: dict[int, int | None] | None = None) -> LaunchStatus:
    nodes = {
        "node-a": NodeStatus("node-a", NodeState.RUNNING, {0: None, 1: None}, last_seen=NOW),
        "node-b": NodeStatus("node-b", b_state, b_codes or {2: None, 3: None}, last_seen=NOW,
                             notice=notice),
    }
    state = AttemptState.FAILED if b_state is NodeState.FAILED else AttemptState.RUNNING
    return LaunchStatus(state, nodes)


def _check(status: LaunchStatus) -> object:
    obs = Observation(now=NOW, launched_at=NOW - 60.0, heartbeats={}, node_ranks=NODE_RANKS,
                      heartbeat_interval=0.5, launch=status)
    return Detector(Detection()).check(obs)


def test_a_notice_is_a_preempted_fault_naming_the_node_not_a_rank() -> None:
    fault = _check(_status(Notice(30.0, NOW + 20.0)))
    assert fault is not None
    assert (fault.kind, fault.culprit_node, fault.culprit_rank) == (
        FaultKind.PREEMPTED, "node-b", None)
    assert fault.evidence["drain_by"] == NOW + 20.0
    assert fault.evidence["grace_seconds"] == 30.0
    assert "preemption notice" in fault.evidence["summary"] and "20.0s left" in \
        fault.evidence["summary"]


def test_a_preempted_node_whose_ranks_were_stopped_is_still_preempted_not_a_crash() -> None:
    status = _status(Notice(30.0, NOW - 1.0), NodeState.FAILED, {2: -15, 3: -15})
    fault = _check(status)
    assert fault is not None and fault.kind is FaultKind.PREEMPTED


def test_without_a_notice_the_same_exit_is_the_killed_ranks_fault() -> None:
    status = _status(None, NodeState.FAILED, {2: -9, 3: -15})
    fault = _check(status)
    assert fault is not None and fault.kind is FaultKind.LAUNCH_FAILURE  # no heartbeat yet
    assert fault.culprit_rank == 2


def test_the_preempted_rule_can_be_switched_off() -> None:
    obs = Observation(now=NOW, launched_at=NOW - 60.0, heartbeats={}, node_ranks=NODE_RANKS,
                      heartbeat_interval=0.5, launch=_status(Notice(30.0, NOW + 20.0)))
    detector = Detector(Detection(), enabled=frozenset(FaultKind) - {FaultKind.PREEMPTED})
    assert detector.check(obs) is None
