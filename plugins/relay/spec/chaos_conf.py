"""Fault injection from a DAG run's conf: refused unless the job's spec says ``chaos: allowed``.

Without the opt-in anyone who can trigger a DAG could kill a production job
with a run conf. The check runs in preflight, before any MLflow run is opened,
and again in every segment (a segment can be cleared and run on its own).
Entries typed into Airflow's trigger form as JSON text are parsed back into
objects; anything else that is not a valid fault is refused with the fix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relay.core.exceptions import ChaosConfError
from relay.spec.job import JobSpec
from relay_train.protocol.injection import KINDS, InjectedFault

CHAOS_EXAMPLE = '[{"kind": "crash", "segment": 1, "step": 75, "rank": 1, "attempt": 1}]'

# The `chaos` DAG param's JSON Schema: an array of objects, so the trigger form shows a
# JSON editor and hands each fault over as an object, not as a string.
CHAOS_ITEMS: dict[str, Any] = {
    "type": "object",
    "properties": {"kind": {"type": "string", "enum": list(KINDS)}},
    "required": ["kind"],
}


def _as_object(entry: object, index: int) -> dict[str, Any]:
    if isinstance(entry, str):
        try:
            entry = json.loads(entry)
        except ValueError:
            pass
    if not isinstance(entry, dict):
        raise ChaosConfError(
            f"DAG run conf `chaos`[{index}]: expected a JSON object such as "
            f"{CHAOS_EXAMPLE[1:-1]}, found {entry!r}. Fix the conf and trigger again.")
    return entry


def chaos_faults(conf: Mapping[str, Any] | None, spec: JobSpec, spec_file: Path) -> list[dict]:
    """Return the faults a DAG run's conf asks for; raise ChaosConfError if not allowed or bad."""
    raw = (conf or {}).get("chaos") or []
    if not raw:
        return []
    if not spec.chaos_allowed:
        raise ChaosConfError(
            f"DAG run conf `chaos`: job {spec.job!r} does not allow fault injection "
            f"({spec_file} has no `chaos: allowed`), found {raw!r}. Fix: trigger the run "
            f"without `chaos`, or, for a test or demo job only, add the line `chaos: allowed` "
            f"to {spec_file}.")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            pass
    if not isinstance(raw, list):
        raise ChaosConfError(f"DAG run conf `chaos`: expected a list such as {CHAOS_EXAMPLE}, "
                             f"found {raw!r}. Fix the conf and trigger again.")
    faults = [_as_object(entry, i) for i, entry in enumerate(raw)]
    for i, fault in enumerate(faults):
        try:
            InjectedFault.from_dict(fault)
        except (ValueError, TypeError) as exc:
            raise ChaosConfError(f"DAG run conf `chaos`[{i}]: {exc} in {fault!r}. Fix the conf "
                                 "and trigger again.") from exc
    return faults
