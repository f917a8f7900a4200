"""When Airflow cannot act on a detected fault: stop the faulty workload within a bound.

A fault the watcher detects is handled by ``execute_complete``, which runs only
once Airflow's scheduler resumes the deferred task. With the scheduler down, a
hung workload would hold its nodes until it comes back. So the watcher, when it
fires a fault the policy acts on, also starts a **warden**: a small detached
process (``python -m relay.recover.warden``) that waits
``detection.stop_unattended_after`` seconds from the detection. If
``execute_complete`` has taken the attempt by then, the warden just leaves.
Otherwise it does the safe part itself: it asks the ranks for their stacks,
has a healthy rank hand over its in-memory state (or has the ranks drain to a
checkpoint, when the rule is ``checkpoint_and_migrate``), stops every process
of the attempt, and writes what it did to ``unattended/stopped.json``. The
decision, the quarantine, publishing the rescued state and the MLflow record
stay with ``execute_complete``, which reads that file when it runs (after the
stop the warden also logs it, the evidence and the rescued state to the
attempt's MLflow run, for an ``execute_complete`` on another machine: see
:mod:`relay.recover.warden_results`). The bound: the workload is stopped at most
``stop_unattended_after`` + ``checkpoint_timeout`` (rescue or drain) +
:data:`BOUND_MARGIN_SECONDS` (the agents' claim, 2 s, and 2 x the stop grace,
5 s each) after the fault was detected.

Exactly one of them acts on an attempt, however many watchers fired (Airflow
may run a trigger twice), on one machine or several. On one machine each takes
the attempt's lease, an exclusive ``flock`` on ``unattended/lease.lock`` (freed
by the kernel if its holder dies), and acts only if ``claimed.json`` is not
there yet, writing it first; the warden holds the lock while it works, so
``execute_complete`` waits for a warden mid-stop and then uses its results.
Across machines the attempt's node agents decide (:mod:`relay.recover.claim`): the
warden acts only if they grant it the claim, and ``execute_complete`` that
finds it held by a warden elsewhere waits for that warden's results.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FOLDER = "unattended"
WARDEN_FILE = "warden.json"
CLAIM_FILE = "claimed.json"
STOPPED_FILE = "stopped.json"
LOCK_FILE = "lease.lock"
POLL_SECONDS = 0.5
STOP_GRACE_SECONDS = 5.0
CLAIM_SECONDS = 2.0  # recover.claim.CLAIM_TIMEOUT_SECONDS (this module imports no HTTP client)
BOUND_MARGIN_SECONDS = CLAIM_SECONDS + 2 * STOP_GRACE_SECONDS
EARLY_CLAIM_MARGIN_SECONDS = 10.0  # covers clock skew between the triggerer and a worker

# What the warden does before the stop, per fault kind (the policy's rule decides it).
RESCUE, DRAIN, STOP = "rescue", "drain", "stop"

log = logging.getLogger(__name__)


def folder(attempt_dir: Path) -> Path:
    """Return where an attempt's warden and its lease live."""
    return attempt_dir / FOLDER


def plan(policy: Any, history: list[Any], policy_sha256: str) -> dict[str, str]:  # noqa: ANN401
    """Return, per fault kind the policy acts on, what a warden does before stopping.

    Observe-mode kinds are left out: their faults are never acted on, attended or not.
    """
    from relay.core.faults import RESCUABLE, Fault, FaultKind
    from relay.policy.decide import decide
    steps: dict[str, str] = {}
    for kind in FaultKind:
        decision = decide(Fault(kind, None, None, {}), history, policy, policy_sha256)
        if decision.observe:
            continue
        if decision.checkpoint_first:
            steps[kind.value] = DRAIN
        elif decision.retry and not decision.rollback and kind in RESCUABLE:
            steps[kind.value] = RESCUE
        else:
            steps[kind.value] = STOP
    return steps


def start_warden(attempt_dir: Path, fault_event: dict[str, Any], step: str,
                 detection: dict[str, Any], launcher: dict[str, Any] | None) -> int | None:
    """Start the attempt's warden unless one was already started; return its PID."""
    after = detection.get("stop_unattended_after")
    if after is None:
        return None
    where = folder(attempt_dir)
    where.mkdir(parents=True, exist_ok=True)
    try:  # one warden per attempt, however many watchers fire
        fd = os.open(where / WARDEN_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return None
    args = {"attempt_dir": str(attempt_dir), "fault": fault_event, "step": step,
            "after_seconds": float(after),
            "checkpoint_timeout": float(detection.get("checkpoint_timeout", 120.0)),
            "evidence_timeout": float(detection.get("evidence_timeout", 2.0)),
            "launcher": launcher}
    (where / "args.json").write_text(json.dumps(args, default=str))
    log_dir = attempt_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / "unattended.log").open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay.recover.warden", str(where / "args.json")],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    with os.fdopen(fd, "w") as record:
        json.dump({"pid": proc.pid, "started_at": time.time()}, record)
    return proc.pid


@contextmanager
def lease(attempt_dir: Path, wait_seconds: float | None) -> Iterator[bool]:
    """Hold the attempt's lease (``None``: wait as long as it takes); yield whether we got it."""
    where = folder(attempt_dir)
    where.mkdir(parents=True, exist_ok=True)
    with open(where / LOCK_FILE, "a") as lock:
        deadline = None if wait_seconds is None else time.monotonic() + wait_seconds
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.1)
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def claimed_by(attempt_dir: Path) -> dict[str, Any] | None:
    """Return who took the attempt (execute_complete or the warden), if anyone did."""
    try:
        return dict(json.loads((folder(attempt_dir) / CLAIM_FILE).read_text()))
    except (OSError, ValueError):
        return None


def _write_claim(attempt_dir: Path, by: str) -> None:
    from relay_train.protocol.heartbeat import write_atomically

    write_atomically(folder(attempt_dir) / CLAIM_FILE, json.dumps(
        {"by": by, "pid": os.getpid(), "at": time.time()}), durable=True)


@dataclass
class Stopped:
    """What a warden did before ``execute_complete`` ran."""

    by: str
    detected_at: float
    stopped_at: float
    step: str
    survivors: list[str]
    rescued: dict[str, Any] | None = None  # relay_train.protocol.rescue_files.RescueResult fields
    drained_at: int | None = None
    evidence_request: dict[str, Any] | None = None  # {id, ranks}

    @classmethod
    def read(cls, attempt_dir: Path) -> Stopped | None:
        """Return the warden's record, if it finished its work."""
        try:
            raw = json.loads((folder(attempt_dir) / STOPPED_FILE).read_text())
            return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})
        except (OSError, ValueError, TypeError):
            return None


def take_over(attempt_dir: Path, wait_seconds: float, launcher: Any = None,  # noqa: ANN401
              fetch: Callable[[], Stopped | None] | None = None,
              warden_due: float | None = None) -> Stopped | None:
    """Take the attempt for ``execute_complete``; return what a warden already did, if any.

    Waits (up to ``wait_seconds``) for a warden that is stopping the attempt right now: on
    this machine (its lease), or elsewhere (the agents name it, see :mod:`relay.recover.claim`;
    ``fetch`` then brings what it saved, see :mod:`relay.recover.warden_results`). ``warden_due``:
    when a warden would claim the attempt (None: there is none). Well before then the
    agents' claim is sent without waiting for their answers (a frozen agent's timeout stays
    off the recovery's path): no warden can hold it yet.
    """
    with lease(attempt_dir, wait_seconds) as held:
        if not held:
            log.warning("The warden of %s still holds its lease after %.0fs; going on without "
                        "it", attempt_dir, wait_seconds)
            return Stopped.read(attempt_dir)
        claim = claimed_by(attempt_dir)
        if claim is None:
            _write_claim(attempt_dir, "execute_complete")
            if launcher is None or warden_due is None:
                return None
            from relay.recover.claim import claim_attempt, claimer

            by = claimer("execute_complete")
            if time.time() < warden_due - EARLY_CLAIM_MARGIN_SECONDS:
                threading.Thread(target=claim_attempt, args=(launcher, attempt_dir, by),
                                 name="relay-claim", daemon=True).start()
                return None
            outcome = claim_attempt(launcher, attempt_dir, by)
            if outcome.won:
                return None
            log.warning("%s is held by %s (agents: %s); waiting up to %.0fs for what it saved",
                        attempt_dir, outcome.holder, outcome.describe(), wait_seconds)
            return _wait_for_results(attempt_dir, wait_seconds, fetch)
    stopped = Stopped.read(attempt_dir)
    if stopped is None:
        log.warning("%s was claimed by %s, which left no record (it died?); handling it in full",
                    attempt_dir, claim)
    return stopped


def _wait_for_results(attempt_dir: Path, wait_seconds: float,
                      fetch: Callable[[], Stopped | None] | None) -> Stopped | None:
    """Return the record of a warden on another machine once it is readable, else None."""
    deadline = time.monotonic() + wait_seconds
    while True:
        stopped = Stopped.read(attempt_dir)
        if stopped is None and fetch is not None:
            try:
                stopped = fetch()
            except Exception as exc:  # noqa: BLE001 - the store may be busy: look again
                log.info("The warden's record of %s is not readable yet (%s)", attempt_dir, exc)
        if stopped is not None:
            return stopped
        if time.monotonic() >= deadline:
            log.warning("No record from the warden of %s after %.0fs; handling it in full",
                        attempt_dir, wait_seconds)
            return None
        time.sleep(1.0)


def results(warden: Stopped, decision: Any, fault: Any,  # noqa: ANN401 - Decision, Fault
            attempt_dir: Path) -> tuple[Any, int | None, Any]:  # noqa: ANN401
    """Return (evidence, drained step, rescue) from what the warden saved.

    The rescue counts only where the decision would have asked for it, and only if its
    file still matches the sha256 the rank reported.
    """
    from relay.core.faults import RESCUABLE
    from relay.recover.evidence import RECEIVED_DIR, kept_evidence
    from relay_train.protocol.manifest import file_sha256
    from relay_train.protocol.rescue_files import RescueResult

    log.warning("The workload was stopped by its warden %.1fs after the fault was detected "
                "(no one resumed the task sooner); using what it saved",
                warden.stopped_at - warden.detected_at)
    evidence = None  # gathered over the channel before the stop; the agents are gone now
    if warden.evidence_request is not None:
        evidence = kept_evidence(attempt_dir / RECEIVED_DIR,
                                 list(warden.evidence_request["ranks"]))
    drained = warden.drained_at if decision.checkpoint_first else None
    rescued = None
    if warden.rescued is not None and decision.retry and not decision.rollback \
            and fault.kind in RESCUABLE:
        candidate = RescueResult(**warden.rescued)
        if candidate.path and file_sha256(Path(candidate.path)) == candidate.sha256:
            rescued = candidate
        else:
            log.warning("The rescued state %s no longer matches its sha256; not used",
                        candidate.path)
    return evidence, drained, rescued


# -- the warden process ------------------------------------------------------------------


def _act(args: dict[str, Any], cfg: Any, launcher: Any, save: bool) -> Stopped:  # noqa: ANN401
    """Snapshot what is cheap to save (if an agent answers), then stop the attempt (run
    under the lease and the agents' claim)."""
    from relay.core.faults import Fault
    from relay.recover.ask_rescue import request_rescue, silent
    from relay.recover.drain import drain
    from relay.recover.evidence import ask_for_evidence, collect_evidence

    attempt_dir = Path(args["attempt_dir"])
    fault = Fault.from_event(args["fault"]["fault"])
    launcher.channel(attempt_dir).mark_silent(silent(fault, cfg)[0])
    asked = rescued = drained = None
    if not save:
        log.warning("No agent of %s answers: nothing to save from; stopping it", attempt_dir)
    try:  # whatever goes wrong saving, the stop below is the point
        asked = None if not save else ask_for_evidence(attempt_dir, fault, cfg, launcher)
        if save and args["step"] == DRAIN:
            drained = drain(attempt_dir, args["checkpoint_timeout"], launcher)
        elif save and args["step"] == RESCUE:
            rescued = request_rescue(attempt_dir, cfg, fault, args["checkpoint_timeout"],
                                     launcher)
        if asked is not None:  # the answers are on disk now; execute_complete summarises them
            collect_evidence(asked, args["evidence_timeout"])
    except Exception:  # noqa: BLE001 - logged; the retry resumes from the last checkpoint
        log.exception("Could not save the state of %s before stopping it", attempt_dir)
    survivors = launcher.stop(attempt_dir, STOP_GRACE_SECONDS)
    return Stopped(
        by=f"warden pid {os.getpid()}", detected_at=float(fault.detected_at),
        stopped_at=time.time(), step=args["step"], survivors=survivors,
        rescued=None if rescued is None else asdict(rescued), drained_at=drained,
        evidence_request=None if asked is None else {"id": asked.request_id,
                                                     "ranks": asked.ranks})


def run_warden(args: dict[str, Any]) -> str:
    """Wait out the bound; stop the attempt unless execute_complete took it. Return why."""
    attempt_dir = Path(args["attempt_dir"])
    detected = float(args["fault"]["fault"].get("detected_at") or time.time())
    deadline = detected + float(args["after_seconds"])
    while time.time() < deadline:
        if claimed_by(attempt_dir) is not None:
            return "claimed"
        time.sleep(POLL_SECONDS)
    from relay.core import settings
    from relay.launchers import launch_record, launcher_from
    from relay.recover.claim import claim_attempt, claimer

    launcher = launcher_from(args.get("launcher"))
    # The watcher's event carries the launch record: no file of the launching machine needed.
    cfg = launch_record.find(attempt_dir, launcher, settings.mlflow_tracking_uri(),
                             args["fault"].get(launch_record.KEY))
    with lease(attempt_dir, 0.0) as held:
        if not held or claimed_by(attempt_dir) is not None:
            return "claimed"
        outcome = claim_attempt(launcher, attempt_dir, claimer("warden"))
        if not outcome.won:  # execute_complete (or another warden) elsewhere has it
            log.warning("%s is held by %s (agents: %s); leaving it", attempt_dir,
                        outcome.holder, outcome.describe())
            return "claimed"
        _write_claim(attempt_dir, "warden")
        log.warning("No one handled the %s fault of %s within %.0fs of its detection (is "
                    "Airflow's scheduler down?); stopping the workload (%s first)",
                    args["fault"]["fault"].get("kind"), attempt_dir, args["after_seconds"],
                    args["step"])
        stopped = _act(args, cfg, launcher, save=bool(outcome.granted) or not outcome.nodes)
        from relay_train.protocol.heartbeat import write_atomically

        write_atomically(folder(attempt_dir) / STOPPED_FILE,
                         json.dumps(asdict(stopped), default=str), durable=True)
        log.warning("Stopped %s %.1fs after the fault was detected (rescued: %s, drained at: %s, "
                    "survivors: %s); execute_complete decides and records when it runs",
                    attempt_dir, stopped.stopped_at - stopped.detected_at,
                    stopped.rescued and stopped.rescued.get("step"), stopped.drained_at,
                    stopped.survivors or "none")
    _publish(cfg, attempt_dir, stopped)
    return "stopped"


def _publish(cfg: Any, attempt_dir: Path, stopped: Stopped) -> None:  # noqa: ANN401
    """Put the results where execute_complete on another machine reads them (MLflow, now
    that the workload is stopped: no frozen rank holds the tracking store's lock)."""
    from relay.lineage.store import Lineage
    from relay.recover.warden_results import publish

    try:
        publish(Lineage.from_settings(), cfg.run_id, attempt_dir, stopped)
    except Exception:  # noqa: BLE001 - the record stays here; execute_complete may be too
        log.exception("Could not log what the warden saved to MLflow run %s", cfg.run_id)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m relay.recover.warden ARGS_JSON``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("args_file", type=Path)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s unattended: %(message)s")
    args = json.loads(ns.args_file.read_text())
    outcome = run_warden(args)
    log.info("Warden of %s done: %s", args["attempt_dir"], outcome)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
