"""Fault injection from inside a rank, for tests, demos and benchmarks.

A fault is a dict from the DAG run's conf, e.g.
``{"kind": "crash", "segment": 1, "step": 30, "rank": 1, "attempt": 1}``:
strike at global ``step`` on ``rank`` (or every rank of ``node``), only on
that segment attempt (``attempt`` defaults to 1, so Airflow's retry runs
clean).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

KINDS = ("crash",)


@dataclass(frozen=True)
class Fault:
    """One planned fault."""

    kind: str
    step: int
    segment: int | None = None
    rank: int | None = None
    node: str | None = None
    attempt: int = 1

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Fault:
        """Build a fault from run conf; reject unknown kinds and fields."""
        kind = raw.get("kind")
        if kind not in KINDS:
            raise ValueError(f"chaos fault kind: expected one of {KINDS}, found {kind!r}")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"chaos fault: unknown fields {sorted(unknown)}")
        for name in ("step", "segment", "rank", "attempt"):
            value = raw.get(name)
            required = name == "step"
            if (required or value is not None) and not isinstance(value, int):
                raise ValueError(f"chaos fault {name}: expected a whole number, found {value!r}")
        return cls(**raw)

    def strikes(self, *, segment: int, attempt: int, step: int, rank: int, node: str) -> bool:
        """Return whether this fault hits this rank now."""
        if self.segment is not None and self.segment != segment:
            return False
        if self.attempt != attempt or self.step != step:
            return False
        if self.rank is not None and self.rank != rank:
            return False
        return self.node is None or self.node == node


class ChaosMonkey:
    """Apply the faults planned for this rank as its steps go by."""

    def __init__(
        self, faults: list[dict[str, Any]], *, segment: int, attempt: int, rank: int, node: str
    ) -> None:
        self._faults = [Fault.from_dict(f) for f in faults]
        self._where = {"segment": segment, "attempt": attempt, "rank": rank, "node": node}

    def before_step(self, step: int) -> None:
        """Strike any fault planned for ``step``."""
        for fault in self._faults:
            if fault.strikes(step=step, **self._where):
                log.warning("CHAOS: injecting %s at step %d (%s)", fault.kind, step, self._where)
                if fault.kind == "crash":
                    os.kill(os.getpid(), signal.SIGKILL)
