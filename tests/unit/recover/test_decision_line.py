"""Unit tests for the task log's one decision line per fault, and the details after it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from relay.core.faults import Fault, FaultKind
from relay.policy.decide import Decision
from relay.recover.record import LINE_LIMIT, decision_details, decision_line

HANG = Fault(FaultKind.HANG, 1, "node-a",
             {"summary": "rank 1 stalled in compute while 3 rank(s) wait " + "x" * 600}, 100.0)
RESTART = Decision(
    kind="hang", action="restart_elsewhere", retry=True, backoff_seconds=0.0,
    quarantine_node="node-a", quarantine_seconds=3600.0, checkpoint_first=False,
    rollback=False, notify=None, rule="rules.hang", occurrence=1, max_attempts=3,
    policy_sha256="ab6f6311df7f" + "0" * 52,
    reason="the 1st hang in this segment (limit 3): rules.hang says restart_elsewhere; " * 5)


def test_the_line_names_kind_culprit_decision_resume_step_and_lost_steps() -> None:
    line = decision_line(1, HANG, RESTART, step=35, resumed=35, lost=0)

    assert line == ("Segment 1 fault: hang (node node-a, rank 1) at step 35 -> "
                    "restart_elsewhere by rules.hang, its node out; resumes at step 35, "
                    "0 steps lost")
    assert "stalled" not in line and "the 1st hang" not in line  # details come after it


@pytest.mark.parametrize("resumed,lost,ends", [
    (None, None, "resumes at step unknown, lost steps unknown"),
    (20, 15, "resumes at step 20, 15 steps lost"),
])
def test_unknowns_are_said_not_guessed(resumed: int | None, lost: int | None,
                                       ends: str) -> None:
    assert decision_line(0, HANG, RESTART, step=35, resumed=resumed, lost=lost).endswith(ends)


def test_no_retry_and_observe_mode_say_so() -> None:
    escalate = dataclasses.replace(RESTART, action="escalate", retry=False,
                                   quarantine_node=None)
    assert decision_line(0, HANG, escalate, step=12, resumed=10, lost=2).endswith(
        "-> escalate by rules.hang; no retry, 2 steps lost")
    assert decision_line(0, HANG, RESTART, applied=False).endswith(
        "-> restart_elsewhere by rules.hang, its node out")


def test_the_line_stays_short_with_long_names_and_big_numbers() -> None:
    pod = "relay-" + "very-long-kubernetes-pod-name-" * 6
    fault = Fault(FaultKind.THROUGHPUT_DEGRADED, 4095, pod, {}, 100.0)
    decision = dataclasses.replace(RESTART, action="checkpoint_and_migrate",
                                   quarantine_node=pod + "-host", rule="rules." + "x" * 80)

    line = decision_line(999, fault, decision, step=10**7, resumed=10**7 - 5, lost=10**4)

    assert len(line) < LINE_LIMIT, line
    assert "rank 4095" in line and "10000 steps lost" in line  # shortened names only


def test_the_details_follow_with_evidence_where_it_stopped_and_why(tmp_path: Path) -> None:
    recorded = {**HANG.to_event()["fault"]}
    recorded["evidence"] = {**HANG.evidence, "where": "rank 1 in chaos_hang_forever"}

    details = decision_details(recorded, RESTART, tmp_path, tmp_path / "logs")

    lines = details.splitlines()
    assert lines[0].startswith("  evidence: rank 1 stalled in compute")
    assert str(tmp_path / "decision.json") in lines[0]
    assert lines[1] == "  where it stopped: rank 1 in chaos_hang_forever"
    assert lines[2].startswith("  why: the 1st hang") and "ab6f6311df7f" in lines[2]
    assert lines[3] == f"  logs: {tmp_path / 'logs'}"
