"""Unit tests for the texts of Relay's Airflow notes (task instance and DAG run)."""

from __future__ import annotations

import dataclasses

from relay.lineage.notes import NOTE_LIMIT, fault_note, run_note, task_note
from relay.lineage.report import FaultRow

HANG = FaultRow(0, "hang", "rank 1, node-a", 2.0, "restart_elsewhere (node-a out)", 0, 5.6,
                try_number=1, rank=1, node="node-a", rule="rules.hang", retry=True, step=35,
                resume_step=35, retry_nodes=["node-b", "node-c"])


def test_a_recovered_fault_reads_as_the_issue_asks() -> None:
    assert fault_note(HANG) == (
        "Recovered: hang of rank 1 on node-a at step 35 → restarted on node-b, node-c from "
        "step 35, 0 steps lost (rules.hang), back in 5.6s")


def test_before_the_retry_launches_and_when_the_policy_gives_up() -> None:
    pending = dataclasses.replace(HANG, retry_nodes=None, time_to_resume=None)
    assert fault_note(pending) == ("Retrying: hang of rank 1 on node-a at step 35 → "
                                   "restart_elsewhere (node-a out) by rules.hang, from step "
                                   "35, 0 steps lost")
    crash = dataclasses.replace(HANG, kind="crash", rank=3, node="node-b", decision="escalate",
                                rule="rules.crash", retry=False, step=12, lost_steps=None,
                                retry_nodes=None, time_to_resume=None)
    assert fault_note(crash) == ("Not retried: crash of rank 3 on node-b at step 12 → "
                                 "escalate by rules.crash, lost steps unknown")


def test_the_task_note_lists_its_own_segment_only() -> None:
    other = dataclasses.replace(HANG, segment=1, kind="straggler")
    assert task_note([HANG, other], 0) == fault_note(HANG)
    assert task_note([other], 0) is None  # a segment without faults gets no note


def test_the_run_note_sums_up_faults_lost_steps_and_time_lost() -> None:
    frozen = dataclasses.replace(HANG, segment=1, kind="node_unresponsive", rank=None,
                                 lost_steps=3, time_to_resume=None, retry_nodes=None)
    second_hang = dataclasses.replace(HANG, segment=2, time_to_resume=4.4)

    note = run_note([HANG, frozen, second_hang], 12.34)

    assert note is not None
    head, *lines = note.splitlines()
    assert head == ("Relay: 3 faults (hang ×2, node_unresponsive); 3 steps lost; "
                    "12.3s of training time lost so far (1 not resumed yet)")
    assert lines[1].startswith("- segment 1: Retrying: node_unresponsive of node-a at step 35")
    assert run_note([]) is None  # a fault-free run gets no note
    assert run_note([HANG], 7.0).splitlines()[0] == (  # type: ignore[union-attr]
        "Relay: 1 fault (hang); 0 steps lost; 7.0s of training time lost")


def test_a_long_run_fits_airflows_note_and_counts_the_rest() -> None:
    rows = [dataclasses.replace(HANG, segment=i) for i in range(40)]

    note = run_note(rows, 300.0)

    assert note is not None and len(note) <= NOTE_LIMIT
    assert note.startswith("Relay: 40 faults (hang ×40); 0 steps lost; 300.0s of training")
    shown = sum(1 for line in note.splitlines() if line.startswith("- segment"))
    assert note.endswith(f"… and {40 - shown} more (Relay's Recovery page lists all)")
