"""One attempt, one state machine: the :class:`Attempt` value and its :class:`AttemptState`.

An attempt is one try of one segment task of one DAG run. Its folder is
``$RELAY_HOME/runs/<dag_id>/<run>/segment-NNN/try-N``: the try's own records
(decision, fault, resume time) live there. Its workload (the node agents and
ranks) normally runs there too; a try that adopted the workload an earlier
segment left training (local launcher) watches a workload that runs in that
earlier try's folder: :attr:`Attempt.workload`.

The life of an attempt, as every part of Relay names it::

    LAUNCHING --> RUNNING --> COMPLETED                    every rank reached the end
                     |
                     +--> FAULTED --> HANDLING --> RECORDED   the watcher named a fault; the
                     |       |                                recovery pipeline stopped the
                     |       +--> RUNNING (observe mode)      attempt and recorded it
                     |
                     +--> FAILED        ended with no fault to decide on (the watcher broke,
                                        processes survived their stop, no boundary checkpoint)
    any state but a final one --> ABANDONED   its task was killed; a new try replaces it

Trigger events carry the state the watcher saw (``completed``, ``faulted`` or
``failed``), the task's journal (:mod:`relay.recover.journal`) the state the task
reached, and an attempt's MLflow run its :attr:`AttemptState.outcome`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from relay.core.exceptions import IllegalTransitionError

SEGMENT_DIR = re.compile(r"segment-(\d+)")
TRY_DIR = re.compile(r"try-(\d+)")  # an attempt folder; set-aside ones (try-N.stale-T) never match
# In an attempt's folder: the checkpoint interval its launch chose (an adopting try keeps it).
INTERVAL_FILE = "checkpoint_interval.json"


class AttemptState(StrEnum):
    """Where an attempt stands (the module docstring draws the machine)."""

    LAUNCHING = "launching"
    RUNNING = "running"
    FAULTED = "faulted"
    HANDLING = "handling"
    RECORDED = "recorded"
    COMPLETED = "completed"
    FAILED = "failed"
    ABANDONED = "abandoned"

    @property
    def final(self) -> bool:
        """Return whether nothing follows this state."""
        return not TRANSITIONS[self]

    @property
    def outcome(self) -> AttemptState:
        """Return what an MLflow run shows: a faulted attempt stays ``faulted`` while its
        fault is handled and once it is recorded."""
        return AttemptState.FAULTED if self in (AttemptState.HANDLING,
                                                AttemptState.RECORDED) else self

    def to(self, new: AttemptState) -> AttemptState:
        """Return ``new`` if the machine allows this state to become it; raise if not."""
        if new not in TRANSITIONS[self]:
            allowed = ", ".join(sorted(TRANSITIONS[self])) or "nothing (it is final)"
            raise IllegalTransitionError(
                f"an attempt in state {self.value} cannot become {new.value}: expected one "
                f"of {allowed}. This is a bug in Relay; please report it with the task log.")
        return new

    def reaches(self, new: AttemptState) -> bool:
        """Return whether the machine can lead from this state to ``new`` in some steps (a
        record of the attempt may skip states it did not keep, never go backwards)."""
        seen, todo = set(), [self]
        while todo:
            for state in TRANSITIONS[todo.pop()] - seen:
                if state is new:
                    return True
                seen.add(state)
                todo.append(state)
        return False

    @classmethod
    def from_outcome(cls, text: str | None) -> AttemptState:
        """Read an MLflow run's outcome tag, written by this version or an earlier one."""
        if text is None:
            return cls.RUNNING
        try:
            return cls(text)
        except ValueError:
            return _EARLIER_OUTCOMES.get(text, cls.FAILED)


# Outcome tags earlier versions of Relay wrote, as this machine names them.
_EARLIER_OUTCOMES = {
    "fault": AttemptState.FAULTED, "orphans": AttemptState.FAILED,
    "watcher_error": AttemptState.FAILED, "no_checkpoint": AttemptState.FAILED,
    "skipped": AttemptState.COMPLETED,
}

_S = AttemptState
TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    _S.LAUNCHING: frozenset({_S.RUNNING, _S.FAILED, _S.ABANDONED}),
    _S.RUNNING: frozenset({_S.COMPLETED, _S.FAULTED, _S.FAILED, _S.ABANDONED}),
    _S.FAULTED: frozenset({_S.HANDLING, _S.RUNNING, _S.ABANDONED}),
    # A task killed while handling leaves HANDLING behind: its retry handles it again.
    _S.HANDLING: frozenset({_S.HANDLING, _S.RECORDED}),
    _S.RECORDED: frozenset(),
    _S.COMPLETED: frozenset(),
    _S.FAILED: frozenset(),
    _S.ABANDONED: frozenset(),
}


@dataclass(frozen=True)
class Attempt:
    """One try of one segment of one DAG run: its folder, its workload's, its nodes."""

    folder: Path
    workload: Path | None = None  # where its processes run, when not in ``folder`` (adopted)
    nodes: tuple[str, ...] = field(default=())

    @property
    def runs_in(self) -> Path:
        """Return the folder of the processes this attempt watches (its launcher's key)."""
        return self.workload or self.folder

    @property
    def adopted(self) -> bool:
        """Return whether this attempt watches a workload an earlier segment launched."""
        return self.workload is not None and self.workload != self.folder

    @property
    def segment_dir(self) -> Path:
        """Return the folder of every try of this attempt's segment."""
        return self.folder.parent

    @property
    def run_dir(self) -> Path:
        """Return the DAG run's folder."""
        return self.folder.parent.parent

    @property
    def segment(self) -> int | None:
        """Return the segment index the folder names (None off Relay's layout)."""
        found = SEGMENT_DIR.fullmatch(self.segment_dir.name)
        return int(found.group(1)) if found else None

    @property
    def try_number(self) -> int | None:
        """Return the try number the folder names (None off Relay's layout)."""
        found = TRY_DIR.fullmatch(self.folder.name)
        return int(found.group(1)) if found else None

    @property
    def dag_id(self) -> str:
        """Return the DAG's id (the folder above the run's)."""
        return self.run_dir.parent.name

    @property
    def run(self) -> str:
        """Return the DAG run's folder name (its id, made safe for a path)."""
        return self.run_dir.name

    def describe(self) -> str:
        """Return e.g. ``segment 0 try 2`` (and the workload it adopted)."""
        where = f"segment {self.segment} try {self.try_number}"
        return f"{where} (adopted {self.workload})" if self.adopted else where

    def __str__(self) -> str:
        return str(self.folder)


def attempt_dirs(segment_dir: Path) -> list[Path]:
    """Return a segment's attempt folders (``try-N`` exactly), in try order."""
    found = [(int(m.group(1)), p) for p in segment_dir.glob("try-*")
             if (m := TRY_DIR.fullmatch(p.name)) and p.is_dir()]
    return [p for _n, p in sorted(found)]
