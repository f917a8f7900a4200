"""Read a segment attempt's state from its Job, its pods and their nodes (pure functions).

Each node slot gets one :class:`~relay.launchers.base.NodeStatus`: the pod's phase,
unless the pod outlived its deletion deadline or its node has a problem, which
makes the slot ``unresponsive`` (:class:`~relay_train.protocol.routes.NodeState`), or
it carries the condition DisruptionTarget (evicted, preempted, drained), which makes it
failed with a detail starting ``preempted:``;
what its agent said over the channel adds exit codes, failed ranks' log tails, a
preemption notice and when it last answered. No API calls here;
:mod:`relay.launchers.k8s.launcher` fetches the objects and asks the agents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relay.launchers.base import PREEMPTED, NodeStatus, notice_of
from relay.launchers.k8s.objects import DISRUPTION_CONDITION, INDEX_ANNOTATION
from relay_train.protocol.routes import ERRORS, EXIT_CODES, SETTLED, STATE, NodeState

if TYPE_CHECKING:
    from relay.launchers.agent_client import NodeReport

TERMINATING_SLACK_SECONDS = 2.0  # past deletionTimestamp + this, a pod is stuck


def epoch(stamp: Any) -> float | None:  # noqa: ANN401 - datetime or None
    """Return a client timestamp as epoch seconds."""
    return None if stamp is None else stamp.timestamp()


def newest_by_index(pods: list[Any]) -> dict[int, Any]:
    """Return the newest pod of each completion index."""
    chosen: dict[int, Any] = {}
    for pod in pods:
        raw = (pod.metadata.annotations or {}).get(INDEX_ANNOTATION) or (
            pod.metadata.labels or {}).get(INDEX_ANNOTATION)
        if raw is None:
            continue
        index = int(raw)
        old = chosen.get(index)
        if old is None or (epoch(pod.metadata.creation_timestamp) or 0) >= (
                epoch(old.metadata.creation_timestamp) or 0):
            chosen[index] = pod
    return chosen


def stuck(pod: Any, now: float) -> bool:  # noqa: ANN401 - V1Pod
    """Return whether a pod outlived its deletion deadline (its kubelet is not acting)."""
    deleting = epoch(pod.metadata.deletion_timestamp)
    return deleting is not None and now > deleting + TERMINATING_SLACK_SECONDS


def slot_status(slot: str, pod: Any, problems: dict[str, str | None],  # noqa: ANN401
                 now: float) -> NodeStatus:
    """Say what one node slot is doing, from its pod and its node."""
    if pod is None:
        return NodeStatus(slot, NodeState.STARTING, detail="no pod yet")
    host = pod.spec.node_name if pod.spec else None
    phase = pod.status.phase if pod.status else None
    if phase == "Succeeded":
        return NodeStatus(slot, NodeState.SUCCEEDED, host=host)
    disrupted = disruption(pod)
    if disrupted and phase != "Succeeded":  # evicted or preempted: failing, not crashed
        return NodeStatus(slot, NodeState.FAILED, detail=disrupted, host=host)
    if phase == "Failed":
        return NodeStatus(slot, NodeState.FAILED, detail=failure_detail(pod), host=host)
    if stuck(pod, now):
        late = now - (epoch(pod.metadata.deletion_timestamp) or now)
        return NodeStatus(slot, NodeState.UNRESPONSIVE, host=host, detail=(
            f"pod {pod.metadata.name} stuck terminating on {host} for {late:.0f}s past its "
            "grace period"))
    if host and problems.get(host):
        return NodeStatus(slot, NodeState.UNRESPONSIVE, detail=str(problems[host]), host=host)
    if phase == "Running":
        return NodeStatus(slot, NodeState.RUNNING, host=host)
    if phase == "Unknown":
        return NodeStatus(slot, NodeState.UNRESPONSIVE, host=host,
                          detail=f"pod {pod.metadata.name} state unknown (node lost?)")
    return NodeStatus(slot, NodeState.STARTING, detail=pending_detail(pod), host=host)


def merge_agent_report(node: NodeStatus, report: NodeReport | None) -> None:
    """Add what the slot's agent last said over the channel: when (and its round trip),
    exit codes, rank errors.

    The pod's phase stays the word on a node that stopped answering; an agent that says
    its ranks ended (it answers a little longer) settles a pod still ``Running``.
    """
    if report is None:
        return
    record = report.record
    node.last_seen, node.round_trip = report.received_at, report.round_trip
    node.exit_codes = {int(r): c for r, c in (record.get(EXIT_CODES) or {}).items()}
    node.errors = {int(r): str(t) for r, t in (record.get(ERRORS) or {}).items()}
    node.notice = notice_of(record, report.received_at)
    if node.state == NodeState.RUNNING and record.get(STATE) in SETTLED:
        node.state = NodeState(record[STATE])
        failed = {r: c for r, c in node.exit_codes.items() if c not in (None, 0)}
        node.detail = f"ranks exited with {failed}" if failed else node.detail


def disruption(pod: Any) -> str | None:  # noqa: ANN401 - V1Pod
    """Return ``"preempted: ..."`` when the pod carries the condition DisruptionTarget (an
    eviction, a preemption, a drain, a NoExecute taint), else None."""
    for cond in (pod.status.conditions or []) if pod.status else []:
        if cond.type == DISRUPTION_CONDITION and cond.status == "True":
            return (f"{PREEMPTED}: pod {pod.metadata.name} on {pod.spec.node_name}: "
                    f"{cond.reason or 'disrupted'}: {cond.message or 'no message'}")
    return None


def failure_detail(pod: Any) -> str:  # noqa: ANN401
    for cs in pod.status.container_statuses or []:
        done = cs.state.terminated if cs.state else None
        if done is not None:
            return (f"pod {pod.metadata.name}: agent exited with code {done.exit_code}"
                    f" ({done.reason or 'no reason'})")
    return f"pod {pod.metadata.name} failed: {pod.status.reason or 'no reason'}"


def pending_detail(pod: Any) -> str:  # noqa: ANN401
    for cond in pod.status.conditions or [] if pod.status else []:
        if cond.type == "PodScheduled" and cond.status == "False":
            return f"unschedulable: {cond.message or cond.reason}"
    for cs in (pod.status.container_statuses or []) if pod.status else []:
        if cs.state and cs.state.waiting:
            return f"waiting: {cs.state.waiting.reason}"
    return "pending"


def job_failure(job: Any) -> str | None:  # noqa: ANN401
    for cond in (job.status.conditions or []) if job.status else []:
        if cond.type == "Failed" and cond.status == "True":
            # reason PodFailurePolicy: the policy's FailJob rule matched a disrupted pod
            # (objects.pod_failure_policy); that pod's slot says preempted.
            return f"Job failed: {cond.reason}: {cond.message}"
    if job.status and job.status.failed:  # before the condition: a pod failed or vanished
        return f"Job has {job.status.failed} failed pod(s)"
    return None
