"""A rank that died before its first step because its rendezvous port was taken: nobody's fault.

The message is the one a loaded benchmark met (docs/benchmarks.md): rank 0's TCPStore could
not listen on the port the launcher had picked, taken meanwhile by another process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import relay.core.settings
from relay.core.attempt import AttemptState
from relay.core.faults import CULPRIT_CHECK, Fault, FaultKind
from relay.launchers.base import LaunchStatus, NodeStatus
from relay.policy.decide import decide
from relay.policy.model import Detection, load_policy
from relay.watch.detection import Detector
from relay.watch.exits import PORT_TAKEN, port_taken
from relay.watch.observation import Observation
from relay_train.protocol.heartbeat import Heartbeat, Phase
from relay_train.protocol.routes import NodeState

NODE_RANKS = {"node-a": [0, 1], "node-b": [2, 3]}
NOW = 1_700_000_100.0
DEFAULT_POLICY = Path(relay.core.settings.REPO_ROOT) / "policies" / "default.yaml"
TAKEN = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any "
         "local network address. port: 35371, useIpv6: false, code: -98, name: EADDRINUSE, "
         "message: address already in use")
TRACEBACK = ("Traceback (most recent call last):\n"
             '  File "/x/torch/distributed/rendezvous.py", line 189, in _create_c10d_store\n'
             "    return TCPStore(\n           ^^^^^^^^^\n")


def failed(error: str) -> LaunchStatus:
    """Rank 0 exited with code 1 and ``error`` last in its log; its peers followed it."""
    return LaunchStatus(AttemptState.FAILED, {
        "node-a": NodeStatus("node-a", NodeState.FAILED, {0: 1, 1: -15}, last_seen=NOW,
                             errors={0: TRACEBACK + error}),
        "node-b": NodeStatus("node-b", NodeState.FAILED, {2: -15, 3: -15}, last_seen=NOW),
    })


def fault_of(status: LaunchStatus) -> Fault | None:
    """Return what a fresh detector calls ``status``, rank 0 never past start-up."""
    beats = {r: Heartbeat(rank=r, node="node-b", pid=100 + r, step=0, phase=Phase.STARTING.value,
                          phase_started_at=NOW - 5, wall_clock=NOW - 1, seq=0) for r in (2, 3)}
    obs = Observation(now=NOW, launched_at=NOW - 20, heartbeats=beats, node_ranks=NODE_RANKS,
                      heartbeat_interval=0.5, launch=status)
    return Detector(Detection()).check(obs)


@pytest.mark.parametrize(("error", "port"), [
    (TAKEN, 35371),
    # torch before 2.4 said it this way
    ("torch.distributed.DistNetworkError: The server socket has failed to bind to [::]:29500 "
     "(errno: 98 - Address already in use).", 29500),
])
def test_a_store_that_found_its_port_taken_is_recognised(error: str, port: int) -> None:
    assert port_taken(failed(error)) == (0, port)


@pytest.mark.parametrize("error", [
    "RuntimeError: boom",
    "torch.distributed.DistNetworkError: Connection reset by peer",  # a peer's death
    "OSError: [Errno 98] Address already in use",  # the script's own socket, not the store
], ids=["plain", "connection-reset", "own-socket"])
def test_other_exits_are_not_a_taken_port(error: str) -> None:
    assert port_taken(failed(error)) is None


def test_a_taken_rendezvous_port_is_a_launch_failure_with_nobody_to_blame() -> None:
    fault = fault_of(failed(TAKEN))
    assert fault is not None and fault.kind is FaultKind.LAUNCH_FAILURE
    assert (fault.culprit_rank, fault.culprit_node) == (None, None), fault.describe()
    assert fault.evidence[PORT_TAKEN] == 35371
    assert fault.evidence["summary"].startswith(
        "rendezvous port 35371 taken by another process: rank exited before its first step: "
        "rank 0 exited with code 1: torch.distributed.DistNetworkError"), fault.describe()
    assert "expected the rendezvous port 35371 free" in fault.evidence[CULPRIT_CHECK]["note"]
    assert fault.detected_at == NOW


def test_a_plain_exit_before_the_first_step_still_blames_its_node() -> None:
    fault = fault_of(failed("RuntimeError: boom"))
    assert fault is not None and fault.kind is FaultKind.LAUNCH_FAILURE
    assert (fault.culprit_rank, fault.culprit_node) == (0, "node-a"), fault.describe()
    assert fault.evidence["summary"] == ("rank exited before its first step: rank 0 exited "
                                         "with code 1: RuntimeError: boom")
    assert PORT_TAKEN not in fault.evidence and CULPRIT_CHECK not in fault.evidence


def test_the_default_policy_retries_a_taken_port_and_quarantines_nobody() -> None:
    policy = load_policy(DEFAULT_POLICY).policy
    taken, plain = fault_of(failed(TAKEN)), fault_of(failed("RuntimeError: boom"))
    assert taken is not None and plain is not None
    decision = decide(taken, [], policy, "ab" * 32)
    assert decision.retry and decision.action == "restart_elsewhere"
    assert decision.quarantine_node is None and decision.quarantine_seconds is None
    assert decision.avoid_node is None
    assert "expected the rendezvous port 35371 free" in decision.reason
    assert "nobody is quarantined" in decision.reason
    # the same exit without the taken port: its node is quarantined, as before
    assert decide(plain, [], policy, "ab" * 32).quarantine_node == "node-a"
