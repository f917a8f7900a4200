"""One recovery: what it works with, and what it ends in.

The segment task builds a :class:`Recovery` with its :class:`TaskSide` (policy,
journal, MLflow); the warden builds one without. :func:`relay.recover.pipeline.handle`
runs it and returns an :class:`Outcome`, which the caller acts on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relay.core.attempt import Attempt, AttemptState
from relay.core.faults import Fault
from relay.launchers import Launcher
from relay.policy.decide import Decision
from relay.policy.model import Detection, LoadedPolicy
from relay.recover import claim
from relay_train.protocol.launch import LaunchConfig


@dataclass
class TaskSide:
    """What only the segment task brings to a recovery: its policy, journal and MLflow."""

    context: Mapping[str, Any]  # Airflow's task context (the task state store)
    policy: LoadedPolicy
    lineage: Any  # relay.lineage.store.Lineage; touched only after the stop
    parent_run: Callable[[], str]  # the DAG run's MLflow run (looked up after the stop)
    segment: int
    holder: str  # who holds the DAG run's node lease
    nodes_needed: int
    woke: float  # when the deferred task ran again (time to resume: wake)
    refused: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Recovery:
    """One fault of one attempt, and what its recovery works with."""

    attempt: Attempt
    fault: Fault
    cfg: LaunchConfig  # the workload's launch record, as this attempt sees it
    launcher: Launcher
    detection: Detection
    task: TaskSide | None = None  # None: the warden, which saves and stops only
    step: str | None = None  # the warden's: what to save, named when the watch began

    @property
    def role(self) -> str:
        """Return who runs this recovery: the task or the warden."""
        return claim.WARDEN if self.task is None else claim.TASK


@dataclass
class Outcome:
    """What a recovery ended in, for its caller to act on.

    ``state``: RECORDED (the fault is handled and recorded), RUNNING (observe mode: the
    attempt trains on, watch ``watch_kinds``), COMPLETED (observe mode: it ended well),
    HANDLING (the warden stopped it; the task records it) or FAULTED (the warden left
    it to another actor).
    """

    state: AttemptState
    decision: Decision | None = None
    message: str = ""
    retry: bool = False  # Airflow runs the segment again after decision.backoff_seconds
    watch_kinds: list[str] | None = None
