"""The launcher seam: what Relay needs from wherever a segment attempt runs.

Operators, watchers and the recovery pipeline talk to a :class:`Launcher` only, and
get one from :func:`relay.launchers.launcher_from`; only that factory names a
concrete launcher. An attempt travels as a :class:`relay.core.attempt.Attempt`:
the local launcher keeps its handle in the folder its workload runs in
(:attr:`Attempt.runs_in`); the Kubernetes launcher derives its object names from
that folder's last four parts, so any worker finds the same Job again. The
launcher chooses where the ranks meet (rendezvous address and port) when it
launches.

What a launcher reports of an attempt's workload is an
:class:`~relay.core.attempt.AttemptState`::

    launch() --> RUNNING --> COMPLETED      every node's agent ended well
                     \\--> FAILED          an agent or a rank failed, or the attempt vanished

Everything Relay learns from a running attempt, and everything it asks of it,
goes over the network to the node agents (:meth:`Launcher.channel`, see
:mod:`relay.launchers.agent_client`): :meth:`Launcher.status` carries the ranks'
heartbeats, already placed on Relay's clock, the segment boundaries rank 0
recorded crossing, and the messages refused from agents of another attempt. No
launcher reads a file a node wrote.

Per node, :class:`NodeStatus` says what its agent reports, a
:class:`~relay_train.protocol.routes.NodeState`: ``starting``, ``running``,
``succeeded``, ``failed``, or ``unresponsive`` (the platform says the node
stopped answering: a NotReady Kubernetes node, a pod stuck terminating); the
detector turns ``unresponsive`` into a ``node_unresponsive`` fault at once. A node
whose agent got the platform's preemption notice carries it (:class:`Notice`,
read by :func:`notice_of`); the detector turns it into a ``preempted`` fault.

A launcher whose agents outlive an attempt (the local one) also offers
:class:`Continuity` as ``launcher.continuity``: agents kept warm for the next
attempt, and workloads handed over from one segment to the next. Others set it
to None, and every attempt launches afresh.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from relay.core.attempt import Attempt, AttemptState
from relay_train.protocol.routes import (
    AGE_SECONDS,
    DRAIN_SECONDS,
    GRACE_SECONDS,
    PREEMPTED,
    NodeState,
)

if TYPE_CHECKING:
    from relay.launchers.agent_client import AgentChannel
    from relay.nodes.pool import Quarantine
    from relay.spec.job import JobSpec
    from relay_train.protocol.heartbeat import Heartbeat
    from relay_train.protocol.launch import LaunchConfig


# How a launcher says a node was taken away (evicted, preempted, reclaimed), not crashed:
# a FAILED NodeStatus whose detail starts "preempted:" (PREEMPTED, the fault kind's name).


@dataclass(frozen=True)
class Notice:
    """A preemption notice a node's agent received: the platform takes the node back
    ``grace_seconds`` after it, and the agent stops its ranks at ``drain_by`` (epoch
    seconds on Relay's clock), so a drain must be done by then."""

    grace_seconds: float
    drain_by: float


def notice_of(record: dict[str, Any], received_at: float) -> Notice | None:
    """Return the notice an agent's status ``record`` reports (None: none, or malformed),
    placed on Relay's clock by when the answer was received."""
    raw = record.get(PREEMPTED)
    if not isinstance(raw, dict):
        return None
    try:
        grace, age = float(raw[GRACE_SECONDS]), float(raw[AGE_SECONDS])
        drain = float(raw.get(DRAIN_SECONDS, grace))
    except (KeyError, TypeError, ValueError):
        return None
    if not (grace >= 0 and age >= 0 and drain >= 0):
        return None
    return Notice(grace, received_at - age + min(drain, grace))


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
    notice: Notice | None = None  # the platform's preemption notice, if one came
    # How long its agent's last status answer took, asked to answered (None: not measured):
    # a slow or lossy link to the node shows here first (relay.watch.slow_link).
    round_trip: float | None = None


@dataclass
class LaunchStatus:
    """The whole workload's state, with per-node detail."""

    state: AttemptState  # RUNNING, COMPLETED or FAILED
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


def overall_state(nodes: dict[str, NodeStatus]) -> AttemptState:
    """Return the attempt's state from its nodes' states."""
    states = {n.state for n in nodes.values()}
    if not nodes or NodeState.FAILED in states:
        return AttemptState.FAILED
    if states == {NodeState.SUCCEEDED}:
        return AttemptState.COMPLETED
    return AttemptState.RUNNING


@runtime_checkable
class Launcher(Protocol):
    """Start, watch and stop segment attempts on some set of nodes."""

    name: str
    continuity: Continuity | None  # see the module docstring

    def config(self) -> dict[str, Any]:
        """Return what :func:`relay.launchers.launcher_from` needs to rebuild this launcher."""
        ...

    def slots(self, nodes: list[str]) -> list[str]:
        """Return the node names an attempt on ``nodes`` (healthy ones Relay picked) uses."""
        ...

    def launch(self, cfg: LaunchConfig) -> Attempt:
        """Start one node agent per node of ``cfg``, choosing the rendezvous; return the
        attempt (its folder is ``cfg.attempt_dir``)."""
        ...

    def handle(self, attempt: Attempt) -> dict[str, Any]:
        """Return what this launcher needs to find a launched attempt again on another
        machine (JSON; it travels with the attempt, see :mod:`relay.launchers.launch_record`)."""
        ...

    def attach(self, attempt: Attempt, handle: dict[str, Any]) -> None:
        """Find ``attempt`` through ``handle`` (from :meth:`handle`), not a file."""
        ...

    def status(self, attempt: Attempt) -> LaunchStatus:
        """Return the attempt's state now, with its heartbeats; never blocks for long."""
        ...

    def channel(self, attempt: Attempt) -> AgentChannel:
        """Return the channel to the attempt's node agents (one per attempt, kept)."""
        ...

    def started_at(self, attempt: Attempt) -> float:
        """Return when the attempt was launched (epoch seconds, on Relay's clock)."""
        ...

    def host_of(self, attempt: Attempt, node: str) -> str:
        """Return the machine ``node`` of a running attempt is on (what a quarantine names)."""
        ...

    def stop(self, attempt: Attempt, grace_seconds: float = 5.0) -> list[str]:
        """Stop every process of the attempt; return what survived (should be nothing)."""
        ...

    def stop_all(self, segment_dir: Path) -> list[str]:
        """Stop every attempt of a segment (e.g. one left behind by a killed task)."""
        ...

    def enforce_quarantines(self, held: dict[str, Quarantine]) -> None:
        """Make the platform keep quarantined hosts out (and let released ones back)."""
        ...


@runtime_checkable
class Continuity(Protocol):
    """What a launcher whose agents and workloads outlive an attempt also offers.

    Warm starts: agents preloaded before an attempt needs them (a resident agent
    per DAG run, standbys for a retry, a spare at the first sign of a fault).
    Handovers (``segment_boundary: adopt``): a segment's workload trains on past
    its end and the next segment's task adopts it instead of restarting it. The
    segment task asks ``launcher.continuity``; when it is None every attempt
    launches afresh and nothing here is called.
    """

    # -- warm starts -------------------------------------------------------------------

    def prepare_run(self, run_dir: Path, nodes: list[str], conf: object, dag_id: str) -> None:
        """Keep an agent preloaded for the DAG run's first segment on ``nodes`` (one a
        runner prestarted and named in the run's ``conf`` is the run's if usable)."""
        ...

    def warm_for_retry(self, faulty: Attempt, nodes: list[str], ttl_seconds: float) -> None:
        """Have the retry's agents preload on ``nodes`` while ``faulty`` is stopped."""
        ...

    def plan_spare(self, attempt: Attempt, free: list[str]) -> dict[str, Any] | None:
        """Return what the watcher of ``attempt`` warms at a sign of a fault (None: no
        free node)."""
        ...

    def warm_spare(self, spare: dict[str, Any], why: str) -> None:
        """Start the planned spare (blocking: a watcher calls it off its event loop)."""
        ...

    def keep_run(self, run_dir: Path, seconds: float) -> None:
        """Renew the DAG run's orchestrator lease for ``seconds``: what is kept warm for the
        run leaves by itself once nobody renews it (its orchestrator was killed)."""
        ...

    def end_run(self, run_dir: Path) -> list[Path]:
        """Stop what still trains for a DAG run that is over, and its warm agents; return
        the workloads stopped."""
        ...

    # -- handovers -----------------------------------------------------------------------

    def hands_over(self, spec: JobSpec) -> bool:
        """Return whether segments of this job hand their workload over."""
        ...

    def run_on(self, spec: JobSpec, index: int) -> tuple[list[int], int | None]:
        """Return the job's segment ends and how far segment ``index``'s workload may train
        on past its own end (None: the job's last segment)."""
        ...

    def guard(self, run_dir: Path, index: int,
              silent_seconds: float) -> AbstractContextManager[None]:
        """Guard a task's MLflow calls while an earlier segment's workload runs unwatched."""
        ...

    def stop_adopted(self, segment_dir: Path) -> list[str]:
        """Stop the workloads earlier tries of this segment adopted; return survivors."""
        ...

    def adoptable(self, run_dir: Path, index: int, end: int, resume_step: int,
                  healthy: list[str]) -> Path | None:
        """Return the workload segment ``index`` may adopt (one it may not is let go of)."""
        ...

    def adopt(self, folder: Path, workload: Path, *, run_id: str, segment: int, attempt: int,
              resume_step: int, end: int, next_end: int | None) -> int | None:
        """Take ``workload`` over for the attempt in ``folder``; return the step it was at
        (None: it was stopped first)."""
        ...

    def kept_interval(self, workload: Path, folder: Path, steps: int) -> dict[str, str]:
        """Record the checkpoint interval an adopting attempt keeps; return MLflow params."""
        ...

    def attempt_at(self, folder: Path) -> Attempt:
        """Return the attempt of a try folder, with the workload it adopted, if any."""
        ...

    def view(self, attempt: Attempt, cfg: LaunchConfig) -> LaunchConfig:
        """Return the workload's launch config as ``attempt`` sees it (its run, its bounds)."""
        ...

    def watch_boundary(self, view: LaunchConfig, workload: LaunchConfig) -> int | None:
        """Return the step whose passing completes the watched segment (None: its end)."""
        ...

    def let_go(self, attempt: Attempt) -> None:
        """Mark the attempt's workload stopped by Relay: never adopt it again."""
        ...

    def note_boundary(self, attempt: Attempt, fired_at: float | None, woke_at: float) -> None:
        """Record when the attempt's watcher saw its boundary and when its task finished."""
        ...

    def wait_published(self, lineage: Any, parent: str, run_id: str, step: int,  # noqa: ANN401
                       timeout_seconds: float, workload: Path) -> bool:
        """Wait (bounded) until the boundary checkpoint at ``step`` is in MLflow."""
        ...

    def copy_strikes(self, attempt: Attempt) -> None:
        """Copy the injected faults aimed at an adopting attempt into its own folder."""
        ...

    def run_id_of(self, attempt: Attempt) -> str:
        """Return the MLflow run of an attempt (the adopting one's, if it adopted)."""
        ...

    def wait_for_end(self, run_dir: Path, index: int) -> None:
        """Let a workload that already trained the last segment finish, then stop it."""
        ...
