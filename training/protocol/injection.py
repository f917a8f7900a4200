"""An injected fault, as Relay accepts it from a DAG run's conf and a rank applies it.

Relay's side validates the run conf's ``chaos`` entries with
:meth:`InjectedFault.from_dict` (``relay.spec.chaos_conf``) and reads what struck from
:data:`CHAOS_LOG`; each rank applies them (:mod:`relay_train.inject`). Not to be
confused with ``relay.core.faults.Fault``, a fault Relay *detected*.

A fault is a dict, e.g.
``{"kind": "hang", "segment": 1, "step": 30, "rank": 1, "attempt": 1}``:
strike at global ``step`` on ``rank`` (or on every rank of ``node``, or every
rank when neither is given), only on that segment attempt (``attempt``
defaults to 1 so Airflow's retry runs clean; ``null`` means every attempt).

One-shot kinds (:data:`ONE_SHOT`) strike once at ``step``: ``crash`` (SIGKILL
the rank), ``hang`` (the rank stops stepping but stays alive), ``stop_rank``
(SIGSTOP the rank: it goes silent), ``stop_node`` (SIGSTOP the rank's whole
process group: the node's agent and every rank on it), ``preempt`` (SIGTERM
the rank's node agent, as a platform's preemption notice would), ``nan`` (the loss
becomes NaN) and ``launch_failure`` (the rank never starts; ``step`` is
ignored). Lasting kinds (:data:`LASTING`) hold from ``step`` on: ``straggler``
(compute takes ``factor`` x as long), ``jitter`` (up to ``seconds`` of random
extra time per step) and ``pace`` (exactly ``seconds`` more per step: a slower
job, not a fault). Every strike is appended to :data:`CHAOS_LOG` in the attempt
folder with its wall-clock time.

``once: true`` makes a one-shot fault strike only the first time the job
reaches ``step``, whichever attempt that is (use ``attempt: null`` with it). A
lasting fault with ``once: true`` is a property of a *node*: the first time the
job reaches ``step``, the node then hosting ``rank`` turns slow and stays slow.
Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ONE_SHOT = ("crash", "hang", "stop_rank", "stop_node", "preempt", "nan", "launch_failure")
LASTING = ("straggler", "jitter", "pace")
KINDS = ONE_SHOT + LASTING
CHAOS_LOG = "chaos.jsonl"  # in the attempt folder: one line per strike
# In the attempt folder, by the node agent: how many of CHAOS_LOG's strikes its status has
# carried to Relay (a node whose disk Relay cannot read; see ChaosMonkey's ``announce``).
CHAOS_SENT = "chaos.sent"


@dataclass(frozen=True)
class InjectedFault:
    """One planned fault."""

    kind: str
    step: int = 0
    segment: int | None = None
    rank: int | None = None
    node: str | None = None
    attempt: int | None = 1
    factor: float = 2.0
    seconds: float = 0.05
    once: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> InjectedFault:
        """Build a fault from run conf; reject unknown kinds, fields and wrong types."""
        kind = raw.get("kind")
        if kind not in KINDS:
            raise ValueError(f"chaos fault kind: expected one of {KINDS}, found {kind!r}")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"chaos fault: unknown fields {sorted(unknown)}")
        for name in ("step", "segment", "rank", "attempt"):
            value = raw.get(name)
            required = name == "step" and kind != "launch_failure"
            if (required or value is not None) and (
                not isinstance(value, int) or isinstance(value, bool)
            ):
                raise ValueError(f"chaos fault {name}: expected a whole number, found {value!r}")
        if "once" in raw and not isinstance(raw["once"], bool):
            raise ValueError(f"chaos fault once: expected true or false, found {raw['once']!r}")
        for name in ("factor", "seconds"):
            if name in raw and not isinstance(raw[name], int | float):
                raise ValueError(f"chaos fault {name}: expected a number, found {raw[name]!r}")
        return cls(**raw)

    def targets(self, *, segment: int, attempt: int, rank: int, node: str) -> bool:
        """Return whether this fault is meant for this rank on this attempt."""
        if self.segment is not None and self.segment != segment:
            return False
        if self.attempt is not None and self.attempt != attempt:
            return False
        if self.rank is not None and self.rank != rank:
            return False
        return self.node is None or self.node == node

    def strikes(self, *, segment: int, attempt: int, step: int, rank: int, node: str) -> bool:
        """Return whether this fault hits this rank at ``step``."""
        if not self.targets(segment=segment, attempt=attempt, rank=rank, node=node):
            return False
        return step >= self.step if self.kind in LASTING else step == self.step
