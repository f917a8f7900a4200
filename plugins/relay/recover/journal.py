"""Where a segment's attempt stands, kept where a killed task's retry can read it.

One entry per segment task of a DAG run, in Airflow's task state store
(AIP-103: ``context["task_state_store"]``, shared by every try of a task
instance in its DAG run and kept in Airflow's metadata database):

- ``running``: ``execute`` started the attempt (its try, attempt folder and
  launch record: config and launcher handle, see :mod:`relay.launchers.launch_record`);
- ``handling``: the recovery pipeline decided about a fault and is stopping and
  recording the attempt (the fault is in the entry);
- ``recorded``: the decision is in ``decision.json`` and MLflow.

These are the attempt's :class:`~relay.core.attempt.AttemptState` values; an entry
that would take the attempt backwards (a ``recorded`` one ``handling`` again)
raises.

Beside it, ``relay_faults`` lists the fault each earlier attempt of the task
ended in (one item per attempt folder, however often its record is finished),
appended when the decision is written: the history the policy's retry limits
count, whichever machine the retry runs on (:func:`fault_history`).

A retry that finds ``handling`` knows the task process died mid-record: it
handles that fault again before anything else (:func:`interrupted`: the same
pure decision, the rescue the healthy rank already wrote, the stop, the
record), exactly once; then it launches its own attempt, unless that fault's
decision gave up (the try then fails for good). When the task state store is
missing from the context (it is there under ``airflow dags test`` too in Airflow 3.3.2),
the entry goes to ``journal.json`` in the segment folder instead, and the
history is counted from the attempt folders' ``decision.json`` files.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from relay.core.attempt import Attempt, AttemptState, attempt_dirs
from relay.core.exceptions import IllegalTransitionError
from relay.core.faults import Fault, FaultKind
from relay.launchers import Launcher, launch_record
from relay_train.protocol.heartbeat import write_atomically
from relay_train.protocol.launch import LaunchConfig

KEY = "relay_attempt"
FAULTS_KEY = "relay_faults"
OBSERVED_KEY = "relay_observed"
FILE = "journal.json"

log = logging.getLogger(__name__)
T = TypeVar("T")


def _store(context: Mapping[str, Any]) -> Any:  # noqa: ANN401 - TaskStateStoreAccessor
    try:
        return context.get("task_state_store")
    except (AttributeError, KeyError):
        return None


def write(context: Mapping[str, Any], segment_dir: Path, state: AttemptState,
          **fields: Any) -> str:  # noqa: ANN401
    """Record ``state`` of the segment's current attempt (``attempt_dir``, and
    ``record_dir`` when it differs); return where it went. Raise
    :class:`~relay.core.exceptions.IllegalTransitionError` if the attempt's entry is at a
    state that cannot lead to ``state``."""
    own = fields.get("record_dir") or fields.get("attempt_dir")
    current = read(context, segment_dir) or {}
    if own is not None and (current.get("record_dir") or current.get("attempt_dir")) == own:
        was = AttemptState(current["state"])
        if not was.reaches(state):
            raise IllegalTransitionError(
                f"{own}: the journal says {was.value}, which cannot become {state.value}")
    entry = {"state": state.value, "at": time.time(), **fields}
    store = _store(context)
    if store is not None:
        store.set(KEY, entry)
        return "task_state_store"
    write_atomically(segment_dir / FILE, json.dumps(entry, default=str), durable=True)
    return str(segment_dir / FILE)


AVOID_NODE = "avoid_node"  # in a recorded entry: the node the next try runs without


def avoided_node(context: Mapping[str, Any], segment_dir: Path) -> str | None:
    """Return the node the previous try's decision said the next try runs without (a
    preempted node: healthy, not quarantined, left out of this one try only)."""
    entry = read(context, segment_dir) or {}
    node = entry.get(AVOID_NODE) if entry.get("state") == AttemptState.RECORDED.value else None
    return node if isinstance(node, str) and node else None


def read(context: Mapping[str, Any], segment_dir: Path) -> dict[str, Any] | None:
    """Return the segment's latest entry, if any."""
    store = _store(context)
    if store is not None:
        found = store.get(KEY)
        return dict(found) if isinstance(found, dict) else None
    try:
        return dict(json.loads((segment_dir / FILE).read_text()))
    except (OSError, ValueError):
        return None


def note_fault(context: Mapping[str, Any], attempt_dir: Path, kind: FaultKind) -> None:
    """Count the fault ``attempt_dir`` ended in, once (a finished record replaces its item)."""
    store = _store(context)
    if store is None:
        return  # the attempt folder's decision.json is the count
    found = store.get(FAULTS_KEY)
    earlier = [f for f in found if isinstance(f, dict) and f.get("attempt_dir")
               != str(attempt_dir)] if isinstance(found, list) else []
    store.set(FAULTS_KEY, [*earlier, {"attempt_dir": str(attempt_dir), "kind": kind.value,
                                      "at": time.time()}])


def note_observation(context: Mapping[str, Any], attempt_dir: Path,
                     record: Mapping[str, Any]) -> None:
    """Keep an observe-mode record of ``attempt_dir`` where every worker sees it."""
    store = _store(context)
    if store is None:
        return  # the attempt folder's observed-NNN.json files are the record
    found = store.get(OBSERVED_KEY)
    earlier = [o for o in found if isinstance(o, dict)] if isinstance(found, list) else []
    store.set(OBSERVED_KEY, [*earlier, {"attempt_dir": str(attempt_dir), "record": record}])


def observations(context: Mapping[str, Any] | None,
                 attempt_dir: Path) -> list[dict[str, Any]] | None:
    """Return the observe-mode records the task state store keeps for ``attempt_dir``,
    oldest first (None without a store: the attempt folder's files are the record)."""
    store = _store(context or {})
    if store is None:
        return None
    found = store.get(OBSERVED_KEY)
    return [dict(o["record"]) for o in found if isinstance(o, dict)
            and o.get("attempt_dir") == str(attempt_dir) and isinstance(o.get("record"), dict)
            ] if isinstance(found, list) else []


def fault_history(context: Mapping[str, Any], segment_dir: Path,
                  exclude: Path | None = None) -> list[FaultKind]:
    """Return the fault kinds earlier attempts of the task ended in, oldest first: those
    the task state store lists, and any attempt folder here with a ``decision.json`` it
    does not (one recorded before the store was used), each attempt once."""
    kinds = faults_by_attempt(segment_dir, exclude)
    store = _store(context)
    found = store.get(FAULTS_KEY) if store is not None else None
    for item in found if isinstance(found, list) else []:
        try:
            if item["attempt_dir"] != str(exclude):
                kinds[str(item["attempt_dir"])] = FaultKind(item["kind"])
        except (KeyError, TypeError, ValueError):
            log.warning("Unreadable item %r in the task state store's %s; not counted",
                        item, FAULTS_KEY)
    return [kinds[a] for a in sorted(kinds, key=_try_number)]


def _try_number(attempt_dir: str) -> tuple[int, str]:
    """Sort key: an attempt folder's try number (``try-N``), then its path."""
    name = Path(attempt_dir).name
    number = name.removeprefix("try-")
    return (int(number) if number.isdigit() else 0, attempt_dir)


def stop_launched(context: Mapping[str, Any], segment_dir: Path, launcher: Launcher,
                  tracking_uri: str) -> list[str]:
    """Stop the attempt an earlier try of this task launched, found by its launch record
    (its folder may be on another machine); return what survived."""
    entry = read(context, segment_dir) or {}
    record = entry.get(launch_record.KEY)
    live = (AttemptState.RUNNING.value, AttemptState.HANDLING.value)
    if entry.get("state") not in live or not record:
        return []
    cfg = launch_record.restore(record, launcher, tracking_uri)
    return launcher.stop(Attempt(cfg.root))


def interrupted(context: Mapping[str, Any], segment_dir: Path, launcher: Launcher,
                tracking_uri: str) -> tuple[Attempt, Fault, LaunchConfig] | None:
    """Return the attempt, fault and launch record a killed try was handling, if any.

    The attempt's folder is the killed try's own; its workload may run elsewhere (that
    try had adopted one). The launch record is restored into ``launcher``.
    """
    entry = read(context, segment_dir)
    if entry is None or entry.get("state") != AttemptState.HANDLING.value:
        return None
    workload = Path(entry["attempt_dir"])
    attempt = Attempt(Path(entry.get("record_dir") or workload), workload)
    fault = Fault.from_event(entry["fault"])
    log.warning("The previous try died while stopping and recording %s (%s); finishing that "
                "first", attempt, fault.describe())
    return attempt, fault, launch_record.find(workload, launcher, tracking_uri,
                                              entry.get(launch_record.KEY))


def finish_interrupted(context: Mapping[str, Any], segment_dir: Path,
                       handle: Callable[[Attempt, Fault, LaunchConfig], T],
                       launcher: Launcher, tracking_uri: str) -> T | None:
    """Handle the fault a killed try was recording, if there is one (:func:`interrupted`);
    return what ``handle`` (the recovery pipeline) returned.

    A handling that raises is logged and marked recorded (with ``error``), so that every
    later try does not fail the same way; None then, as when nothing was interrupted.
    """
    found = interrupted(context, segment_dir, launcher, tracking_uri)
    if found is None:
        return None
    attempt, fault, cfg = found
    try:
        return handle(attempt, fault, cfg)
    except Exception:  # noqa: BLE001 - else every later try would fail here the same way
        log.exception("Could not finish the record of %s; its workload is stopped next and "
                      "this try goes on (the fault stays in the task logs only)", attempt)
        if (read(context, segment_dir) or {}).get("state") != AttemptState.RECORDED.value:
            write(context, segment_dir, AttemptState.RECORDED, attempt_dir=str(attempt.runs_in),
                  record_dir=str(attempt.folder), error=True)
        return None


def faults_by_attempt(segment_dir: Path, exclude: Path | None = None) -> dict[str, FaultKind]:
    """Return, per attempt folder (oldest first), the fault kind its ``decision.json`` names.

    What this machine's folders say (written, fsynced, before anything else records the
    decision); :func:`fault_history` adds what the task state store lists. A folder set
    aside as ``try-N.stale-T`` (the same try launched again) is never counted.
    """
    kinds = {}
    for folder in attempt_dirs(segment_dir):
        record = folder / "decision.json"
        if folder == exclude or not record.exists():
            continue
        try:
            kinds[str(folder)] = FaultKind(json.loads(record.read_text())["fault"]["kind"])
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("Unreadable earlier decision %s; not counted", record)
    return kinds
