"""Segment boundaries that cost almost nothing: adopt the running workload, do not restart it.

With ``segment_boundary: adopt`` (the default, local launcher) a segment's
workload is launched with ``run_on_to`` = the next segment's end: at its own
end it publishes the boundary checkpoint asynchronously and trains on (see
``relay_train.boundary``). Its task's watcher reports ``completed`` once every
rank is past the boundary and the boundary checkpoint is in MLflow; the task
then succeeds *without stopping the workload*. The next segment's task finds
that workload (:func:`live_workload`), checks it may take it over
(:func:`refusal`: still running, not past this segment's end, at or after the
resume checkpoint) and adopts it (:func:`adopt`): ``adopted.json`` in its own
attempt folder points at the workload, ``adopt.json`` in the workload's folder
tells the ranks which MLflow run their later checkpoints belong to and lets
them train one segment further. It then defers on a watcher of that workload
with its own segment's bounds; a fault, also one that struck before the
adoption, is recovered as any other (the retry launches afresh from the latest
checkpoint, and the segments after it adopt that new workload).

Lineage: a checkpoint belongs to the attempt run that watched the workload
when it was made: the boundary checkpoint to the segment that ends there,
those after the adoption to the adopting attempt (its params name the workload
and the step it was at), those made in between (before the next task came) to
the earlier attempt. Every manifest still names its parent, so the chain from
the final model back to step 0 is unbroken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relay.core.attempt import INTERVAL_FILE, Attempt, AttemptState
from relay.launchers import Launcher
from relay.spec.job import JobSpec
from relay_train.protocol.heartbeat import read_heartbeats, write_atomically
from relay_train.protocol.injection import CHAOS_LOG
from relay_train.protocol.launch import (
    ADOPT_FILE,
    FIRST_STEP_FILE,
    LAUNCH_FILE,
    LaunchConfig,
)
from relay_train.protocol.manifest import MANIFEST_FILE, step_dir

log = logging.getLogger(__name__)

ADOPTED_FILE = "adopted.json"  # in the adopting attempt's folder: the workload it watches
BOUNDARY_FILE = "boundary.json"  # in an attempt's folder: when its task saw the boundary
STOPPED_FILE = "let-go.json"  # in a workload's folder: Relay stopped it; never adopt it
# The freeze guard (a thread of the task) and the adoption (the task itself) decide the
# same workload's fate: one of them, never both (a stopped workload adopted is a "crash").
_HANDOVER = threading.Lock()


def lookahead(spec: JobSpec, index: int) -> tuple[list[int], int | None]:
    """Return the job's segment ends and how far segment ``index``'s workload may run on."""
    ends = [end for _i, _s, end in spec.segments]
    return ends, ends[index + 1] if index + 1 < len(ends) else None


def read_adopted(attempt_dir: Path) -> dict[str, Any] | None:
    """Return the adoption an attempt folder records, if its task adopted a workload."""
    try:
        return dict(json.loads((attempt_dir / ADOPTED_FILE).read_text()))
    except (OSError, ValueError):
        return None


def workload_of(attempt_dir: Path) -> Path:
    """Return where the processes an attempt watches run (its own folder unless adopted)."""
    adopted = read_adopted(attempt_dir)
    return Path(adopted["workload"]) if adopted else attempt_dir


def attempt_view(record_dir: Path, cfg: LaunchConfig) -> LaunchConfig:
    """Return the workload's launch config as the adopting attempt sees it (run, bounds)."""
    adopted = read_adopted(record_dir)
    if adopted is None:
        return cfg
    return dataclasses.replace(cfg, run_id=adopted["run_id"], segment=adopted["segment"],
                               attempt=adopted["attempt"], start_step=adopted["resume_step"],
                               end_step=adopted["end_step"])


def watch_boundary(view: LaunchConfig, workload: LaunchConfig) -> int | None:
    """Return the step whose passing completes the watched segment (None: the workload's end)."""
    if workload.run_on_to is None or not workload.boundaries:
        return None
    return view.end_step if view.end_step < max(workload.boundaries) else None


def live_workload(run_dir: Path, index: int, launcher: Launcher) -> Path | None:
    """Return the newest workload an earlier segment launched that Relay has not let go of.

    Running, or failed on its own after its segment's watcher let go of it (a crash in
    the gap before this task came): adopting that one too makes the watcher see the
    fault and recover from it as from any other.
    """
    handles = [h for h in run_dir.glob("segment-*/try-*/handle.json")
               if int(h.parent.parent.name.removeprefix("segment-")) < index]
    for handle in sorted(handles, key=lambda h: h.stat().st_mtime, reverse=True):
        root = handle.parent
        if (root / STOPPED_FILE).exists():
            continue
        if launcher.status(Attempt(root)).state is not AttemptState.COMPLETED:
            return root
    return None


def let_go(workload: Path) -> None:
    """Mark a workload Relay stopped (or handled a fault of): never adopt it again."""
    if (workload / LAUNCH_FILE).exists():
        write_atomically(workload / STOPPED_FILE, json.dumps({"at": time.time()}))


def refusal(workload: Path, end: int, resume_step: int) -> str | None:
    """Return why this segment cannot adopt ``workload`` (None: it can)."""
    try:
        cfg = LaunchConfig.read(workload / LAUNCH_FILE)
    except (OSError, ValueError, TypeError) as exc:
        return f"its launch file is unreadable ({exc})"
    if cfg.run_on_to is None:
        return "it was launched to stop at its segment's end"
    steps = [b.step for b in read_heartbeats(workload / "heartbeats").values()]
    if len(steps) < cfg.world_size:
        return f"only {len(steps)} of {cfg.world_size} ranks have reported"
    if max(steps) > end:
        return f"it is already at step {max(steps)}, past this segment's end {end}"
    # Heartbeats lag by up to an interval (and a crashed rank's stay where it died), so the
    # latest checkpoint may be ahead of some ranks' last word: only a step past it proves
    # the workload made it (within this DAG run there is one workload at a time).
    if max(steps) + cfg.checkpoint_every < resume_step:
        return f"it is at step {max(steps)}, before the latest checkpoint (step {resume_step})"
    return None


def adopt(record_dir: Path, workload: Path, *, run_id: str, segment: int, attempt: int,
          resume_step: int, end: int, next_end: int | None) -> int | None:
    """Take ``workload`` over for this attempt; return the step it was at (None: the
    freeze guard stopped it first).

    It may train on to ``next_end`` (the next segment's end; the job's last step for
    the last segment). One waiting at this segment's end has not checkpointed it yet:
    its rank 0 waits for this adoption first, so the checkpoint goes to this attempt's
    run, and it waits again at ``next_end`` for the next segment's task (every segment
    has its own attempt; a task slower than a whole segment costs that wait).
    The pointer is written first, so a retry of this segment finds (and stops) the
    workload even if this task is killed right after.
    """
    at = max((b.step for b in read_heartbeats(workload / "heartbeats").values()), default=0)
    run_on_to = next_end if next_end is not None else end
    now = time.time()
    record_dir.mkdir(parents=True, exist_ok=True)
    with _HANDOVER:
        if (workload / STOPPED_FILE).exists():
            return None
        write_atomically(record_dir / ADOPTED_FILE, json.dumps({
            "workload": str(workload), "run_id": run_id, "segment": segment,
            "attempt": attempt, "resume_step": resume_step, "end_step": end, "at_step": at,
            "adopted_at": now}), durable=True)
        write_atomically(workload / ADOPT_FILE, json.dumps({
            "run_on_to": run_on_to, "run_id": run_id, "segment": segment,
            "attempt": attempt}), durable=True)
    # Productive from the adoption on (reports and the Recovery page read this file).
    write_atomically(record_dir / FIRST_STEP_FILE, json.dumps(
        {"step": at, "at": now, "node": None, "adopted": True}))
    log.info("Adopted the running workload %s at step %d: steps [%d, %d) go on there, "
             "checkpoints to MLflow run %s; it may train on to step %d",
             workload, at, resume_step, end, run_id, run_on_to)
    return at


def kept_interval(workload: Path, record_dir: Path, steps: int) -> dict[str, str]:
    """Record the checkpoint interval an adopting attempt keeps; return its MLflow params.

    A running workload keeps the interval its launch chose (``checkpoint_every: auto``
    picks one per launch): changing it mid-run would need every rank to switch at
    the same step.
    """
    try:
        choice = dict(json.loads((workload / INTERVAL_FILE).read_text()))
    except (OSError, ValueError):
        choice = {"steps": steps, "mode": None, "reason": ""}
    choice["reason"] = (f"kept from the adopted workload {workload.parent.name}/{workload.name}"
                        f" (chosen at its launch): {choice.get('reason') or steps}")
    choice["adopted_workload"] = str(workload)
    record_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(record_dir / INTERVAL_FILE, json.dumps(choice, indent=2))
    return {"checkpoint_every": str(steps), "checkpoint_every_reason": choice["reason"][:5000]}


def stop_adopted(segment_dir: Path, launcher: Launcher) -> list[str]:
    """Stop the workloads earlier tries of this segment adopted (a task killed mid-watch)."""
    survivors: list[str] = []
    if segment_dir.is_dir():
        for attempt in sorted(segment_dir.iterdir()):
            adopted = read_adopted(attempt)
            if adopted is not None:
                survivors += launcher.stop(Attempt(Path(adopted["workload"])))
                let_go(Path(adopted["workload"]))
    return survivors


def copy_strikes(workload: Path, record_dir: Path) -> None:
    """Copy the workload's chaos strikes aimed at the adopting attempt into its folder."""
    adopted = read_adopted(record_dir)
    source = workload / CHAOS_LOG
    if adopted is None or not source.exists():
        return
    mine = (adopted["segment"], adopted["attempt"])  # a strike in the gap counts too
    lines = [line for line in source.read_text().splitlines() if line.strip()
             and (json.loads(line).get("segment"), json.loads(line).get("attempt")) == mine]
    if lines:
        (record_dir / CHAOS_LOG).write_text("\n".join(lines) + "\n")


def note_boundary(record_dir: Path, fired_at: float | None, woke_at: float) -> None:
    """Record when this attempt's watcher saw the boundary and when its task finished."""
    write_atomically(record_dir / BOUNDARY_FILE, json.dumps(
        {"fired_at": fired_at, "woke_at": woke_at, "done_at": time.time()}))


def wait_published(lineage: Any, parent: str, run_id: str, step: int,  # noqa: ANN401
                   timeout_seconds: float, workload: Path | None = None) -> bool:
    """Wait (bounded) until the checkpoint at ``step`` counts: its manifest is in MLflow.

    It is looked for in ``run_id`` (the run the workload publishes to) and, now and
    then, in every attempt run of the DAG run (a late adoption moves the run later).
    Once Relay has stopped ``workload`` meanwhile (a freeze before it published),
    nothing more can come: one last look, then no.
    """
    deadline = time.monotonic() + timeout_seconds
    polls = 0
    while True:
        names = {a.path.rsplit("/", 1)[-1]
                 for a in lineage.client.list_artifacts(run_id, step_dir(step))}
        if MANIFEST_FILE in names:
            return True
        if polls % 10 == 9 and lineage.has_checkpoint(parent, step):
            return True
        stopped = workload is not None and (workload / STOPPED_FILE).exists()
        if stopped or time.monotonic() >= deadline:
            return lineage.has_checkpoint(parent, step)
        polls += 1
        time.sleep(0.2)


def run_id_of(record_dir: Path) -> str:
    """Return the MLflow run of an attempt (the adopting one's, if it adopted a workload)."""
    adopted = read_adopted(record_dir)
    if adopted is not None:
        return str(adopted["run_id"])
    return LaunchConfig.read(record_dir / LAUNCH_FILE).run_id


def wait_for_end(run_dir: Path, index: int, launcher: Launcher,
                 timeout_seconds: float = 60.0) -> None:
    """Let a workload that already trained the last segment finish publishing; then stop it."""
    workload = live_workload(run_dir, index, launcher)
    if workload is None:
        return
    deadline = time.monotonic() + timeout_seconds
    while (time.monotonic() < deadline
           and launcher.status(Attempt(workload)).state is AttemptState.RUNNING):
        time.sleep(0.2)
    launcher.stop(Attempt(workload))
    let_go(workload)


def _silent(workload: Path, seconds: float) -> list[int]:
    """Return the ranks whose last heartbeat is older than ``seconds``."""
    now = time.time()
    return sorted(r for r, b in read_heartbeats(workload / "heartbeats").items()
                  if now - b.wall_clock > seconds)


def _adopted_by(workload: Path, index: int) -> bool:
    """Return whether segment ``index`` (or a later one) has adopted ``workload``."""
    try:
        return int(json.loads((workload / ADOPT_FILE).read_text())["segment"]) >= index
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def freeze_guard(run_dir: Path, index: int, launcher: Launcher, silent_seconds: float,
                 grace_seconds: float = 5.0) -> Iterator[None]:
    """Stop a running workload that went silent while a task's MLflow calls are blocked.

    Between two segments' watchers nobody stops a workload that freezes. A frozen
    rank can hold the embedded SQLite tracking store's lock, and the tasks that hand
    the workload over must write to that store first: if they are still busy after
    ``grace_seconds`` while a rank of the workload is silent, the workload is
    stopped (its lock goes with it), and the next segment launches afresh from the
    latest checkpoint. With an MLflow server no rank holds a lock, the calls return,
    and the adopting watcher sees the fault and recovers it like any other.
    """
    done = threading.Event()

    def watch() -> None:
        started = time.monotonic()
        while not done.wait(0.5):
            if time.monotonic() - started < grace_seconds:
                continue
            with _HANDOVER:
                workload = live_workload(run_dir, index, launcher)
                if workload is None or _adopted_by(workload, index):
                    return  # gone, or adopted by this task: its own watcher sees any silence
                silent = _silent(workload, silent_seconds)
                if not silent:
                    continue
                let_go(workload)  # first: this task must not adopt what is being stopped
            log.warning("The workload %s went silent between two segments (ranks %s, no "
                        "heartbeat for %.0fs) while this task waits on MLflow: stopping it; "
                        "the next segment resumes from the latest checkpoint",
                        workload, silent, silent_seconds)
            launcher.stop(Attempt(workload))
            return

    thread = threading.Thread(target=watch, name="freeze-guard", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=30)


def stop_run_workloads(run_dir: Path, launcher: Launcher) -> list[Path]:
    """Stop every workload of a DAG run Relay has not let go of (the run failed)."""
    stopped = []
    for handle in run_dir.glob("segment-*/try-*/handle.json"):
        root = handle.parent
        if not (root / STOPPED_FILE).exists() and (
                launcher.status(Attempt(root)).state is AttemptState.RUNNING):
            launcher.stop(Attempt(root))
            let_go(root)
            stopped.append(root)
    return stopped
