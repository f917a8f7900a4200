"""How long a drain after a preemption notice may take, and what is said when it cannot."""

from __future__ import annotations

from relay.core.attempt import AttemptState
from relay.core.faults import Fault, FaultKind
from relay.recover.journal import AVOID_NODE, avoided_node, write
from relay.recover.save_state import MIN_DRAIN_SECONDS, drain_window

NOW = 1_700_000_000.0


def _preempted(drain_by: float) -> Fault:
    return Fault(FaultKind.PREEMPTED, None, "node-b",
                 {"summary": "notice", "drain_by": drain_by, "grace_seconds": 30.0}, NOW)


def test_a_drain_gets_what_is_left_of_the_grace_if_less_than_its_timeout() -> None:
    assert drain_window(_preempted(NOW + 12.0), 120.0, NOW) == (12.0, None)
    assert drain_window(_preempted(NOW + 500.0), 120.0, NOW) == (120.0, None)


def test_too_little_grace_left_means_no_drain_and_says_so() -> None:
    window, note = drain_window(_preempted(NOW + MIN_DRAIN_SECONDS / 2), 120.0, NOW)
    assert window == 0.0
    assert note is not None and "too short to drain" in note and "latest valid checkpoint" in note


def test_other_faults_drain_for_the_whole_timeout() -> None:
    straggler = Fault(FaultKind.STRAGGLER, 3, "node-b", {"drain_by": NOW}, NOW)
    assert drain_window(straggler, 120.0, NOW) == (120.0, None)


def test_the_next_try_reads_the_node_to_avoid_only_from_a_recorded_entry(tmp_path) -> None:
    segment = tmp_path / "segment-000"
    segment.mkdir()
    folder = str(segment / "try-1")
    write({}, segment, AttemptState.RUNNING, attempt_dir=folder)
    assert avoided_node({}, segment) is None
    write({}, segment, AttemptState.HANDLING, attempt_dir=folder)
    write({}, segment, AttemptState.RECORDED, attempt_dir=folder, **{AVOID_NODE: "node-b"})
    assert avoided_node({}, segment) == "node-b"
    write({}, segment, AttemptState.RUNNING, attempt_dir=str(segment / "try-2"))
    assert avoided_node({}, segment) is None  # that try only
