"""A hang's culprit, confirmed against the ranks' stacks and collective trace (pure logic).

The heartbeat phases miss collectives outside the gradient hook (DDP's buffer
broadcast, FSDP's all-gathers, a user's metric all_reduce): the ranks waiting in
one read "compute". These are the two cases issue 29 saw, and the rule's others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import relay.core.settings
from relay.core.attempt import Attempt
from relay.core.faults import Fault, FaultKind
from relay.policy.decide import decide
from relay.policy.model import load_policy
from relay.recover import pipeline
from relay.recover.culprit import CULPRIT_CHECK, confirm_culprit, rank_places
from relay.recover.evidence import Evidence
from relay.recover.recovery import Recovery, TaskSide
from relay.recover.save_state import Saved
from relay_train.protocol.launch import LaunchConfig

SITE = "/venv/lib/python3.11/site-packages/torch"
STALLED = [("/job/train.py", "main"), ("/repo/training/inject.py", "chaos_hang_forever")]
DDP_BROADCAST = [("/job/train.py", "main"), (f"{SITE}/nn/modules/module.py", "_call_impl"),
                 (f"{SITE}/nn/parallel/distributed.py", "forward"),
                 (f"{SITE}/nn/parallel/distributed.py", "_pre_forward"),
                 (f"{SITE}/nn/parallel/distributed.py", "_sync_buffers"),
                 (f"{SITE}/nn/parallel/distributed.py", "_sync_module_buffers"),
                 (f"{SITE}/nn/parallel/distributed.py", "_default_broadcast_coalesced")]
ALL_REDUCE = [("/job/train.py", "main"), (f"{SITE}/distributed/c10d_logger.py", "wrapper"),
              (f"{SITE}/distributed/distributed_c10d.py", "all_reduce")]
BACKWARD = [("/job/train.py", "main"), (f"{SITE}/_tensor.py", "backward"),
            (f"{SITE}/autograd/graph.py", "_engine_run_backward")]


def record(frames: list[tuple[str, str]]) -> dict[str, Any]:
    """Return a rank's stacks record (relay_train.stacks.collect) with this main thread."""
    return {"threads": [
        {"thread": "heartbeat-0", "main": False,
         "frames": [{"file": "/usr/lib/python3.11/threading.py", "line": 1, "function": "wait",
                     "code": ""}]},
        {"thread": "MainThread", "main": True,
         "frames": [{"file": f, "line": 1, "function": fn, "code": ""} for f, fn in frames]}]}


def trace(finished: bool) -> dict[str, Any]:
    """Return a Flight Recorder dump whose last collective did (not) finish."""
    return {"entries": [
        {"collective_seq_id": 7, "profiling_name": "gloo:all_gather", "retired": True},
        {"collective_seq_id": 8, "profiling_name": "gloo:all_gather", "retired": finished}]}


def evidence(stacks: dict[int, list[tuple[str, str]]], traces: dict[int, bool] | None = None,
             fallback: dict[int, str] | None = None) -> Evidence:
    return Evidence(Path("/nowhere"), {r: record(f) for r, f in stacks.items()},
                    {r: trace(done) for r, done in (traces or {}).items()}, fallback or {},
                    [], 0.5)


def hang(rank: int | None) -> Fault:
    return Fault(FaultKind.HANG, rank, None if rank is None else f"node-{rank}",
                 {"summary": "test"}, 1000.0)


def node_of(rank: int) -> str:
    return f"node-{rank}"


RANKS = [0, 1, 2, 3]


def test_a_bystander_in_ddps_buffer_broadcast_is_replaced_by_the_stalled_rank() -> None:
    # Issue 29: rank 1 stalled, ranks 0, 2, 3 wait in the buffer broadcast, all "computing";
    # the phases named rank 3.
    seen = evidence({1: STALLED, 0: DDP_BROADCAST, 2: DDP_BROADCAST, 3: DDP_BROADCAST})
    fault = confirm_culprit(hang(3), seen, RANKS, node_of)
    assert (fault.culprit_rank, fault.culprit_node) == (1, "node-1")
    check = fault.evidence[CULPRIT_CHECK]
    assert (check["heartbeat_culprit"], check["culprit"]) == (3, 1)
    assert "the evidence names rank 1 (in chaos_hang_forever)" in check["note"]
    assert "rank 3 waits in _default_broadcast_coalesced" in check["note"]


def test_no_rank_named_by_the_phases_is_named_by_the_evidence() -> None:
    # Issue 29: rank 0 stalled -> "no rank made progress", no culprit.
    seen = evidence({0: STALLED, 1: ALL_REDUCE, 2: ALL_REDUCE, 3: ALL_REDUCE})
    fault = confirm_culprit(hang(None), seen, RANKS, node_of)
    assert (fault.culprit_rank, fault.culprit_node) == (0, "node-0")
    assert fault.evidence[CULPRIT_CHECK]["note"].startswith("the heartbeats named no rank")


def test_a_culprit_the_stacks_agree_with_is_confirmed() -> None:
    seen = evidence({2: STALLED, 0: BACKWARD, 1: BACKWARD, 3: BACKWARD},
                    traces={2: True, 0: False, 1: False, 3: False})
    fault = confirm_culprit(hang(2), seen, RANKS, node_of)
    assert (fault.culprit_rank, fault.culprit_node) == (2, "node-2")
    assert fault.evidence[CULPRIT_CHECK]["note"].startswith("rank 2 confirmed by its stack")


def test_an_unfinished_collective_in_the_trace_outweighs_a_stack_in_autograd() -> None:
    # DDP's gradient all-reduce is waited on inside the autograd engine: no torch.distributed
    # frame on the stack, but the Flight Recorder shows it unfinished.
    seen = evidence({0: BACKWARD, 1: BACKWARD}, traces={0: False, 1: True})
    places = rank_places(seen)
    assert places[0] == ("collective", "waits in gloo:all_gather #8")
    assert places[1] == ("elsewhere", "in _engine_run_backward")
    assert confirm_culprit(hang(0), seen, [0, 1], node_of).culprit_rank == 1


def test_no_single_rank_outside_a_collective_withdraws_the_culprit() -> None:
    seen = evidence({0: STALLED, 1: STALLED, 2: ALL_REDUCE, 3: ALL_REDUCE})
    fault = confirm_culprit(hang(3), seen, RANKS, node_of)
    assert (fault.culprit_rank, fault.culprit_node) == (None, None)
    assert "no culprit confirmed (rank(s) [0, 1] outside a collective)" in \
        fault.evidence[CULPRIT_CHECK]["note"]
    assert "nobody quarantined" in fault.evidence[CULPRIT_CHECK]["note"]


def test_a_rank_that_sent_nothing_is_never_assumed_innocent() -> None:
    # Rank 1 elsewhere, but rank 3 sent no stacks: it might be the one the others wait for.
    seen = evidence({0: ALL_REDUCE, 1: STALLED, 2: ALL_REDUCE})
    fault = confirm_culprit(hang(0), seen, RANKS, node_of)
    assert fault.culprit_rank is None
    assert "rank(s) [3] sent no stacks" in fault.evidence[CULPRIT_CHECK]["note"]


def test_a_named_rank_without_stacks_is_kept_unconfirmed() -> None:
    seen = evidence({0: ALL_REDUCE, 1: ALL_REDUCE, 2: ALL_REDUCE})
    fault = confirm_culprit(hang(3), seen, RANKS, node_of)
    assert fault.culprit_rank == 3
    assert fault.evidence[CULPRIT_CHECK]["note"] == "rank 3 unconfirmed: it sent no stacks"


def test_a_c_level_stack_counts_as_evidence() -> None:
    stalled = ('Thread 0x00007f01 (most recent call first):\n'
               '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
               'Current thread 0x00007f00 (most recent call first):\n'
               '  File "/job/model.py", line 12 in matmul_forever\n'
               '  File "/job/train.py", line 40 in main\n')
    waiting = ('Current thread 0x00007f00 (most recent call first):\n'
               f'  File "{SITE}/distributed/distributed_c10d.py", line 9 in all_reduce\n'
               '  File "/job/train.py", line 41 in main\n')
    seen = Evidence(Path("/nowhere"), {}, {}, {0: waiting, 1: stalled}, [], 1.0)
    assert confirm_culprit(hang(0), seen, [0, 1], node_of).culprit_rank == 1


@pytest.mark.parametrize("kind", [k for k in FaultKind if k is not FaultKind.HANG])
def test_only_a_hang_is_checked(kind: FaultKind) -> None:
    fault = Fault(kind, 1, "node-1", {"summary": "x"}, 1.0)
    assert confirm_culprit(fault, evidence({0: STALLED, 1: ALL_REDUCE}), [0, 1],
                           node_of) is fault


def test_without_evidence_the_fault_is_unchanged() -> None:
    fault = hang(1)
    assert confirm_culprit(fault, None, [0, 1], node_of) is fault
    assert confirm_culprit(fault, evidence({}), [0, 1], node_of) is fault


def test_the_decision_quarantines_the_confirmed_culprit_or_nobody_and_says_why() -> None:
    policy = load_policy(Path(relay.core.settings.REPO_ROOT) / "policies" / "default.yaml")
    replaced = confirm_culprit(hang(3), evidence(
        {1: STALLED, 0: DDP_BROADCAST, 2: DDP_BROADCAST, 3: DDP_BROADCAST}), RANKS, node_of)
    decision = decide(replaced, [], policy.policy, "ab" * 32)
    assert decision.quarantine_node == ("node-1" if decision.quarantine_seconds else None)
    assert "culprit: rank 3 waits in _default_broadcast_coalesced" in decision.reason

    withdrawn = confirm_culprit(hang(3), evidence(
        {0: STALLED, 1: STALLED, 2: ALL_REDUCE, 3: ALL_REDUCE}), RANKS, node_of)
    decision = decide(withdrawn, [], policy.policy, "ab" * 32)
    assert decision.quarantine_node is None and decision.quarantine_seconds is None
    assert decision.reason.endswith("nobody quarantined")


class Hosts:
    """The launcher's one call ``_decide`` makes: the machine of a node."""

    def host_of(self, attempt: Attempt, node: str) -> str:
        return f"host-of-{node}"


def test_the_pipeline_decides_again_on_the_confirmed_culprit(tmp_path: Path) -> None:
    # Two nodes of two ranks; the phases blamed rank 3 (node-b), rank 1 (node-a) stalled.
    cfg = LaunchConfig(job="t", seed=0, model={}, data={}, optimizer={}, start_step=0,
                       end_step=1, checkpoint_every=1, nodes=["node-a", "node-b"],
                       ranks_per_node=2, master_addr="127.0.0.1", master_port=1,
                       tracking_uri="", run_id="", attempt_dir="", attempt=1, segment=0)
    attempt = Attempt(tmp_path / "segment-000" / "try-1")
    loaded = load_policy(Path(relay.core.settings.REPO_ROOT) / "policies" / "default.yaml")
    task = TaskSide(context={}, policy=loaded, lineage=None, parent_run=str, segment=0,
                    holder="run", nodes_needed=2, woke=0.0)
    blamed = Fault(FaultKind.HANG, 3, "node-b", {"summary": "rank 3 stalled"}, 1.0)
    r = Recovery(attempt, blamed, cfg, Hosts(), loaded.policy.detection, task)  # type: ignore[arg-type]
    first = pipeline._decide(r, task)
    seen = evidence({1: STALLED, 0: DDP_BROADCAST, 2: DDP_BROADCAST, 3: DDP_BROADCAST})

    confirmed, decision = pipeline._confirm(r, task, first, Saved(evidence=seen))
    assert (confirmed.fault.culprit_rank, confirmed.fault.culprit_node) == (1, "node-a")
    assert first.quarantine_node == "host-of-node-b"
    assert decision.quarantine_node == "host-of-node-a"
    assert "the evidence names rank 1" in decision.reason

    unchanged, same = pipeline._confirm(r, task, first, Saved())  # no evidence: as decided
    assert unchanged is r and same is first


@pytest.mark.parametrize("phases", [{2: "checkpoint"}, {"2": "checkpoint"}])  # JSON: str keys
def test_a_rank_stuck_saving_a_checkpoint_is_left_as_named(phases: dict) -> None:
    fault = Fault(FaultKind.HANG, 2, "node-2", {"summary": "stuck saving", "phases": phases})
    seen = evidence({0: ALL_REDUCE, 1: STALLED, 2: ALL_REDUCE})
    assert confirm_culprit(fault, seen, [0, 1, 2], node_of) is fault
