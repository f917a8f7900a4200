"""When Airflow cannot act on a detected fault: stop the faulty workload within a bound.

A fault the watcher detects is handled by ``execute_complete``, which runs only
once Airflow's scheduler resumes the deferred task. With the scheduler down, a
hung workload would hold its nodes until it comes back. So the watcher, when it
fires a fault the policy acts on, also starts a **warden**: a small detached
process (``python -m relay.recover.warden``) that waits
``detection.stop_unattended_after`` seconds from the detection. If
``execute_complete`` has taken the attempt by then, the warden just leaves.
Otherwise it runs the recovery pipeline (:func:`relay.recover.pipeline.handle`)
up to the stop: it claims the attempt, asks the ranks for their stacks, has a
healthy rank hand over its in-memory state (or has the ranks drain to a
checkpoint, when the rule is ``checkpoint_and_migrate``), stops every process of
the attempt, and writes what it did to ``unattended/stopped.json``
(:mod:`relay.recover.warden_record`, also logged to the attempt's MLflow run for
an ``execute_complete`` on another machine). The decision, the quarantine,
publishing the rescued state and the record stay with ``execute_complete``,
which finds the warden's record at its claim. The bound: the workload is stopped
at most ``stop_unattended_after`` + ``checkpoint_timeout`` (rescue or drain) +
:data:`relay.policy.model.UNATTENDED_MARGIN_SECONDS` (the agents' claim and the
stop's two waits) after the fault was detected. Exactly one actor acts on an
attempt, however many watchers fired: see :mod:`relay.recover.claim`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from relay.core import settings
from relay.core.attempt import Attempt, AttemptState
from relay.core.faults import Fault, FaultKind
from relay.launchers import launch_record, launcher_from
from relay.policy.decide import decide
from relay.policy.model import Detection
from relay.recover.claim import claimed_by
from relay.recover.pipeline import handle
from relay.recover.recovery import Recovery
from relay.recover.save_state import save_step
from relay.recover.warden_record import WARDEN_FILE, folder

POLL_SECONDS = 0.5

log = logging.getLogger(__name__)


def plan(policy: Any, history: list[Any], policy_sha256: str) -> dict[str, str]:  # noqa: ANN401
    """Return, per fault kind the policy acts on, what a warden saves before stopping
    (:data:`~relay.recover.save_state.RESCUE`, ``DRAIN`` or ``STOP``).

    Observe-mode kinds are left out: their faults are never acted on, attended or not.
    """
    steps: dict[str, str] = {}
    for kind in FaultKind:
        decision = decide(Fault(kind, None, None, {}), history, policy, policy_sha256)
        if not decision.observe:
            steps[kind.value] = save_step(decision, kind)
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


def run_warden(args: dict[str, Any]) -> str:
    """Wait out the bound; stop the attempt unless execute_complete took it. Return why."""
    attempt_dir = Path(args["attempt_dir"])
    detected = float(args["fault"]["fault"].get("detected_at") or time.time())
    deadline = detected + float(args["after_seconds"])
    while time.time() < deadline:
        if claimed_by(attempt_dir) is not None:
            return "claimed"
        time.sleep(POLL_SECONDS)
    launcher = launcher_from(args.get("launcher"))
    # The watcher's event carries the launch record: no file of the launching machine needed.
    cfg = launch_record.find(attempt_dir, launcher, settings.mlflow_tracking_uri(),
                             args["fault"].get(launch_record.KEY))
    fault = Fault.from_event(args["fault"]["fault"])
    detection = Detection(checkpoint_timeout=args["checkpoint_timeout"],
                          evidence_timeout=args["evidence_timeout"],
                          stop_unattended_after=args["after_seconds"])
    outcome = handle(Recovery(Attempt(attempt_dir), fault, cfg, launcher, detection,
                              step=args["step"]))
    return "stopped" if outcome.state is AttemptState.HANDLING else "claimed"


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
