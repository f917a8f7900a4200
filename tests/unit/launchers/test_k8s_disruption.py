"""A disrupted pod (evicted, preempted, drained) is a preemption of its node, not a crash.

The pods are the official client's models as the launcher reads them; the Job's
podFailurePolicy (objects.pod_failure_policy) fails the Job at such a pod, and the
slot and the fault name it ``preempted``.
"""

from __future__ import annotations

from kubernetes import client

from relay.core.attempt import AttemptState
from relay.core.faults import FaultKind
from relay.launchers.base import PREEMPTED, LaunchStatus, NodeStatus
from relay.launchers.k8s.status import slot_status
from relay.watch.exits import classify_exit
from relay_train.protocol.routes import NodeState


def pod(name: str, phase: str, conditions: list[client.V1PodCondition],
        exit_code: int | None = None) -> client.V1Pod:
    statuses = None if exit_code is None else [client.V1ContainerStatus(
        name="agent", image="i", image_id="", ready=False, restart_count=0,
        state=client.V1ContainerState(terminated=client.V1ContainerStateTerminated(
            exit_code=exit_code, reason="Error")))]
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name),
                        spec=client.V1PodSpec(node_name="gpu-node-2", containers=[]),
                        status=client.V1PodStatus(phase=phase, conditions=conditions,
                                                  container_statuses=statuses))


EVICTED = client.V1PodCondition(type="DisruptionTarget", status="True",
                                reason="EvictionByEvictionAPI",
                                message="Eviction API: evicting")


def test_a_pod_with_disruption_target_is_preempted_while_still_terminating() -> None:
    running = slot_status("pod-1", pod("job-1", "Running", [EVICTED]), {}, 0.0)
    failed = slot_status("pod-1", pod("job-1", "Failed", [EVICTED], exit_code=143), {}, 0.0)

    for status in (running, failed):
        assert status.state == NodeState.FAILED
        assert status.detail.startswith(f"{PREEMPTED}: pod job-1 on gpu-node-2: "
                                        "EvictionByEvictionAPI"), status.detail
    crashed = slot_status("pod-1", pod("job-1", "Failed", [], exit_code=1), {}, 0.0)
    assert not crashed.detail.startswith(PREEMPTED) and "exit" in crashed.detail


def test_the_fault_of_a_preempted_node_names_it_and_not_its_peers_exits() -> None:
    status = LaunchStatus(AttemptState.FAILED, {
        "pod-0": NodeStatus("pod-0", NodeState.FAILED, exit_codes={0: 1},
                            detail="ranks exited with {0: 1}"),
        "pod-1": NodeStatus("pod-1", NodeState.FAILED, exit_codes={1: -15},
                            detail=f"{PREEMPTED}: pod job-1 on gpu-node-2: evicted")})

    fault = classify_exit(status, {"pod-0": [0], "pod-1": [1]})

    assert fault is not None and fault.culprit_node == "pod-1"
    assert fault.evidence["preempted"] == {"pod-1": status.nodes["pod-1"].detail}
    assert fault.kind == FaultKind.PREEMPTED
