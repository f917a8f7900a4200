"""A failed launch as a crash fault: which rank died first, and of what; and a node
taken back by its platform as a ``preempted`` fault (:func:`preemption`).

The culprit is the rank that died of something other than its peers' death. A rank
that ended cleanly before its segment's end (its worker's exit code
``SHORT_SEGMENT_EXIT`` with the line ``short_segment_message`` last in its log, see
:mod:`relay_train.worker`) is a ``short_segment`` fault instead: the step it reached,
the step the job expected.

A rank that died before its first step is a ``launch_failure``
(:func:`before_first_step`), and its node is to blame, unless torch.distributed's
store could not listen because another process held the rendezvous port
(EADDRINUSE): then nobody is, and the retry's launch picks a fresh port.
"""

from __future__ import annotations

import re
import time
from typing import Any

from relay.core.attempt import AttemptState
from relay.core.faults import CULPRIT_CHECK, Fault, FaultKind
from relay.launchers.base import PREEMPTED, LaunchStatus
from relay_train.protocol.launch import SHORT_SEGMENT_EXIT, parse_short_segment
from relay_train.protocol.routes import NodeState

# How the peers of a dead rank end: gloo's "connection reset" (exit 1) or their agent's
# SIGTERM (-15). The culprit is the rank that died of something else.
SECONDARY_EXIT_CODES = frozenset({1, -15})

PORT_TAKEN = "port_taken"  # the key in a launch failure's evidence: the port found taken
# torch.distributed's store failing to listen because another process holds its port:
# "DistNetworkError: The server socket has failed to listen on any local network address.
# port: N, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
# (torch 2.4 on; before: "... failed to bind to [::]:N (errno: 98 - Address already in use)").
_STORE_LISTEN = re.compile(r"DistNetworkError|server socket has failed to (?:listen|bind)")
_IN_USE = re.compile(r"EADDRINUSE|errno:? 98\b|address already in use", re.IGNORECASE)
_PORT = re.compile(r"\bport: (\d+)|:(\d+) \(errno")


def only_secondary_exits(status: LaunchStatus) -> bool:
    """Return whether every failed rank so far ended like a peer of the culprit, not like one."""
    failed = status.failed_ranks()
    return bool(failed) and all(c in SECONDARY_EXIT_CODES for c in failed.values())


def classify_exit(status: LaunchStatus, node_ranks: dict[str, list[int]]) -> Fault | None:
    """Turn a failed launch status into a crash fault naming the first culprit."""
    if status.state is not AttemptState.FAILED:
        return None
    failed = status.failed_ranks()
    # A SIGKILLed or crashed rank takes its peers down with "connection reset"
    # (exit 1) or its agent's SIGTERM (-15); the culprit is the rank that died
    # of something else.
    primary = {r: c for r, c in failed.items() if c not in SECONDARY_EXIT_CODES}
    culprit_rank = min(primary or failed) if failed else None
    culprit_node = next(
        (n for n, ranks in node_ranks.items() if culprit_rank in ranks), None
    )
    if culprit_node is None:
        culprit_node = next(
            (n.node for n in status.nodes.values() if n.state == NodeState.FAILED), None)
    details = {n.node: n.detail for n in status.nodes.values() if n.detail}
    summary = (
        f"rank {culprit_rank} exited with code {failed[culprit_rank]}"
        if culprit_rank is not None
        else f"node agent failed: {details}"
    )
    evidence: dict[str, Any] = {"summary": summary, "exit_codes": failed, "agents": details}
    error = status.errors().get(culprit_rank) if culprit_rank is not None else None
    if error:
        last = next((line for line in reversed(error.splitlines()) if line.strip()), "")
        evidence["summary"] = f"{summary}: {last.strip()}"
        evidence["log_tail"] = error
    taken = {n.node: n.detail for n in status.nodes.values()
             if n.detail.startswith(f"{PREEMPTED}:")}
    if taken:  # the platform took a node away: its peers' exits follow from that
        node = min(taken)
        evidence.update(summary=taken[node], preempted=taken)
        return Fault(FaultKind.PREEMPTED, None, node, evidence)
    short = _short_segment(culprit_rank, failed, error or "")
    if short is not None:
        return Fault(FaultKind.SHORT_SEGMENT, culprit_rank, culprit_node,
                     {**evidence, **short})
    return Fault(
        kind=FaultKind.CRASH,
        culprit_rank=culprit_rank,
        culprit_node=culprit_node,
        evidence=evidence,
    )


def _short_segment(rank: int | None, failed: dict[int, int], log: str) -> dict[str, Any] | None:
    """Return the evidence of a rank that ended cleanly before its segment's end, or None."""
    if rank is None or failed.get(rank) != SHORT_SEGMENT_EXIT:
        return None
    parsed = parse_short_segment(log)
    if parsed is None or parsed[0] != rank:
        return None  # the script's own sys.exit(78): a crash like any other exit code
    _, reached, expected = parsed
    return {"summary": f"rank {rank}'s script returned cleanly at step {reached}; the job "
            f"expected it to train to step {expected}, its segment's end. Fix the script's "
            "loop (for step in session.steps()), then clear the segment task",
            "step": reached, "expected_step": expected}


def preemption(status: LaunchStatus, now: float) -> Fault | None:
    """Return a ``preempted`` fault for the first node whose agent got the platform's
    notice (its ranks are healthy and still train: the recovery drains them)."""
    noticed = [(n.notice.drain_by, n.node, n.notice, n.host) for n in status.nodes.values()
               if n.notice is not None]
    if not noticed:
        return None
    _, node, notice, host = min(noticed, key=lambda found: found[:2])
    left = notice.drain_by - now
    when = time.strftime("%H:%M:%S", time.localtime(notice.drain_by))
    return Fault(FaultKind.PREEMPTED, None, node, {
        "summary": f"{node}'s platform sent a preemption notice (SIGTERM) with a grace "
        f"of {notice.grace_seconds:g}s: drain it by {when} ({max(left, 0.0):.1f}s left)",
        "grace_seconds": notice.grace_seconds, "drain_by": notice.drain_by,
        "host": host, "nodes": sorted(found[1] for found in noticed)}, now)


def port_taken(status: LaunchStatus) -> tuple[int, int] | None:
    """Return (rank, port) of the first failed rank whose log shows torch.distributed's
    store unable to listen because another process held its port; None if none does."""
    for rank, log in sorted(status.errors().items()):
        for line in reversed(log.splitlines()):
            found = _PORT.search(line)
            if found and _STORE_LISTEN.search(line) and _IN_USE.search(line):
                return rank, int(found[1] or found[2])
    return None


def before_first_step(fault: Fault, status: LaunchStatus, now: float) -> Fault:
    """Return the launch failure of ``fault``'s rank, which died before its first step.

    Its node is the culprit, as for any launch failure, unless a rank's store found the
    rendezvous port taken: another process took it between the launcher's pick and the
    store's bind, so no node is to blame (nobody quarantined; the retry's launch picks a
    fresh port).
    """
    summary = f"rank exited before its first step: {fault.evidence['summary']}"
    taken = port_taken(status)
    if taken is None:
        return Fault(FaultKind.LAUNCH_FAILURE, fault.culprit_rank, fault.culprit_node,
                     {**fault.evidence, "summary": summary}, now)
    rank, port = taken
    note = (f"none: expected the rendezvous port {port} free for rank {rank}'s store, found "
            "it taken by another process (EADDRINUSE); not the node's fault, so nobody is "
            "quarantined, and a retry launches on a fresh port")
    check = {"heartbeat_culprit": fault.culprit_rank, "culprit": None, "note": note}
    return Fault(FaultKind.LAUNCH_FAILURE, None, None, {
        **fault.evidence, "summary": f"rendezvous port {port} taken by another process: "
        f"{summary}", PORT_TAKEN: port, CULPRIT_CHECK: check}, now)
