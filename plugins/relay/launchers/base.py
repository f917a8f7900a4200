"""The launcher seam: what Relay needs from wherever a segment attempt runs.

Operators, triggers and recovery talk to a :class:`Launcher` only, and get one
from :func:`relay.launchers.launcher_from`. An attempt is named by its attempt
folder (``.../<dag_id>/<run>/segment-NNN/try-N``): the local launcher keeps its
handle there; the Kubernetes launcher only derives its object names from the
folder's last four parts, so any worker finds the same Job again.

Lifecycle of one attempt, as a launcher reports it (:class:`LaunchState`)::

    launch() --> RUNNING --> SUCCEEDED      every node's agent ended well
                     \\--> FAILED          an agent or a rank failed, or the attempt vanished

Everything Relay learns from a running attempt, and everything it asks of it,
goes over the network to the node agents (:meth:`Launcher.channel`, see
:mod:`relay.launchers.agent_client`): :meth:`Launcher.status` carries the ranks' heartbeats,
already placed on Relay's clock, the segment boundaries rank 0 recorded
crossing, and the messages refused from agents of another attempt. No
launcher reads a file a node wrote.

Per node, :class:`NodeStatus` says what its agent reports, a
:class:`~relay_train.protocol.routes.NodeState`: ``starting``, ``running``,
``succeeded``, ``failed``, or ``unresponsive`` (the platform says the node
stopped answering: a NotReady Kubernetes node, a pod stuck terminating); the
detector turns ``unresponsive`` into a ``node_unresponsive`` fault at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from relay_train.protocol.routes import NodeState

if TYPE_CHECKING:
    from relay.launchers.agent_client import AgentChannel
    from relay.nodes.pool import Quarantine
    from relay_train.protocol.heartbeat import Heartbeat
    from relay_train.protocol.launch import LaunchConfig


class LaunchState(StrEnum):
    """What the launcher knows of a workload."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass
class NodeStatus:
    """One node agent's state as the launcher sees it.

    ``host`` is the machine the node's agent runs on when that differs from
    ``node`` (a Kubernetes pod's node); quarantines name hosts.
    """

    node: str
    state: NodeState
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    detail: str = ""
    last_seen: float | None = None
    host: str | None = None
    errors: dict[int, str] = field(default_factory=dict)  # failed rank -> the end of its log


@dataclass
class LaunchStatus:
    """The whole workload's state, with per-node detail."""

    state: LaunchState
    nodes: dict[str, NodeStatus]
    heartbeats: dict[int, Heartbeat] = field(default_factory=dict)  # on Relay's clock
    refused: list[dict[str, Any]] = field(default_factory=list)  # messages of stale attempts
    crossed: set[int] = field(default_factory=set)  # boundaries rank 0 recorded crossing

    def errors(self) -> dict[int, str]:
        """Return the end of each failed rank's log (its own error message)."""
        return {r: t for n in self.nodes.values() for r, t in n.errors.items()}

    def failed_ranks(self) -> dict[int, int]:
        """Return exit codes of ranks that ended badly."""
        return {
            r: c for n in self.nodes.values() for r, c in n.exit_codes.items() if c not in (None, 0)
        }


def overall_state(nodes: dict[str, NodeStatus]) -> LaunchState:
    """Return the attempt's state from its nodes' states."""
    states = {n.state for n in nodes.values()}
    if not nodes or NodeState.FAILED in states:
        return LaunchState.FAILED
    if states == {NodeState.SUCCEEDED}:
        return LaunchState.SUCCEEDED
    return LaunchState.RUNNING


@runtime_checkable
class Launcher(Protocol):
    """Start, watch and stop segment attempts on some set of nodes."""

    name: str

    def config(self) -> dict[str, Any]:
        """Return what :func:`relay.launchers.launcher_from` needs to rebuild this launcher."""
        ...

    def slots(self, nodes: list[str]) -> list[str]:
        """Return the node names an attempt on ``nodes`` (healthy ones Relay picked) uses."""
        ...

    def launch(self, cfg: LaunchConfig, standby_dir: Path | None = None) -> Path:
        """Start one node agent per node of ``cfg``; return the attempt folder."""
        ...

    def handle(self, root: Path) -> dict[str, Any]:
        """Return what this launcher needs to find a launched attempt again on another
        machine (JSON; it travels with the attempt, see :mod:`relay.launchers.launch_record`)."""
        ...

    def attach(self, root: Path, handle: dict[str, Any]) -> None:
        """Find the attempt at ``root`` through ``handle`` (from :meth:`handle`), not a file."""
        ...

    def status(self, root: Path) -> LaunchStatus:
        """Return the attempt's state now, with its heartbeats; never blocks for long."""
        ...

    def channel(self, root: Path) -> AgentChannel:
        """Return the channel to the attempt's node agents (one per attempt, kept)."""
        ...

    def started_at(self, root: Path) -> float:
        """Return when the attempt was launched (epoch seconds, on Relay's clock)."""
        ...

    def host_of(self, root: Path, node: str) -> str:
        """Return the machine ``node`` of a running attempt is on (what a quarantine names)."""
        ...

    def stop(self, root: Path, grace_seconds: float = 5.0) -> list[str]:
        """Stop every process of the attempt; return what survived (should be nothing)."""
        ...

    def stop_all(self, segment_dir: Path) -> list[str]:
        """Stop every attempt of a segment (e.g. one left behind by a killed task)."""
        ...

    def prestart(self, directory: Path, nodes: list[str], ttl_seconds: float,
                 source: Path | None = None) -> None:
        """Warm up agents for the next attempt on ``nodes`` while ``source`` (the attempt
        being wound down, if any) is stopped."""
        ...

    def reside(self, run_dir: Path, nodes: list[str], prestarted: Path | None = None) -> None:
        """Keep an agent preloaded on each of ``nodes`` for the DAG run (the first
        segment's, from preflight; spares, from a watch), from which a launch or
        :meth:`prestart` forks a standby at once; they leave with the run
        (:func:`relay.launchers.local.adopt.end_run`). ``prestarted``: a resident started before the
        run existed (:mod:`relay.launchers.local.prestart`), for a launcher that can
        use one."""
        ...

    def enforce_quarantines(self, held: dict[str, Quarantine]) -> None:
        """Make the platform keep quarantined hosts out (and let released ones back)."""
        ...
