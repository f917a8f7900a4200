"""`relay chaos`: break a running segment from outside, the way real faults do.

Stop every process of a node (SIGSTOP: the node goes silent), SIGKILL one
rank, or slow a rank by freezing it for part of every 100 ms. Each action is
appended to the attempt's ``chaos.jsonl`` with its time, like the in-rank
injector's, so detection latency can be measured the same way. Every signal
goes through :mod:`training.pids`: a target whose PID now belongs to another
process is left alone and the mismatch logged.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

from relay import settings
from relay.launchers.local import HANDLE_FILE, LaunchState, LocalLauncher
from training import pids
from training.chaos import CHAOS_LOG
from training.heartbeat import read_heartbeats

log = logging.getLogger(__name__)
SLOW_PERIOD_SECONDS = 0.1


class ChaosTargetError(Exception):
    """The thing to break could not be found."""


def running_attempt(dag_id: str | None = None) -> Path:
    """Return the newest running segment attempt (of ``dag_id``, if given)."""
    base = settings.runs_dir() / dag_id if dag_id else settings.runs_dir()
    launcher = LocalLauncher()
    handles = sorted(base.rglob(HANDLE_FILE), key=lambda p: p.stat().st_mtime, reverse=True)
    for handle in handles:
        if launcher.status(handle.parent).state is LaunchState.RUNNING:
            return handle.parent
    raise ChaosTargetError(
        f"no running segment attempt under {base}: expected a folder with {HANDLE_FILE} whose "
        "agents are running. Start a DAG run first, or pass --attempt-dir."
    )


def _record(attempt: Path, action: str, **details: object) -> None:
    entry = {"kind": action, "source": "relay chaos", "at": time.time(), **details}
    with (attempt / CHAOS_LOG).open("a") as fh:
        fh.write(json.dumps(entry) + "\n")


def _node_group(attempt: Path, node: str) -> tuple[int, int | None]:
    """Return the PGID of ``node``'s agent and the agent's recorded start time."""
    handle = json.loads((attempt / HANDLE_FILE).read_text())["nodes"]
    if node not in handle:
        raise ChaosTargetError(f"node {node!r}: expected one of {sorted(handle)} in {attempt}")
    started = handle[node].get("started")
    return int(handle[node]["pgid"]), None if started is None else int(started)


def _not_ours(what: str, attempt: Path) -> ChaosTargetError:
    return ChaosTargetError(
        f"{what}: its recorded process is gone and the PID is not (or no longer) the one "
        f"{attempt} started, so it was left alone. Pick a running attempt.")


def stop_node(attempt: Path, node: str) -> int:
    """SIGSTOP every process of ``node`` (its agent and its ranks); return the PGID."""
    pgid, started = _node_group(attempt, node)
    if not pids.signal_group(pgid, started, signal.SIGSTOP):
        raise _not_ours(f"node {node!r} (process group {pgid})", attempt)
    _record(attempt, "stop_node", node=node, pgid=pgid)
    log.warning("Stopped every process of %s (process group %d)", node, pgid)
    return pgid


def continue_node(attempt: Path, node: str) -> int:
    """SIGCONT every process of ``node`` (undo :func:`stop_node`)."""
    pgid, started = _node_group(attempt, node)
    if not pids.signal_group(pgid, started, signal.SIGCONT):
        raise _not_ours(f"node {node!r} (process group {pgid})", attempt)
    return pgid


def _rank_pid(attempt: Path, rank: int) -> tuple[int, int | None]:
    """Return the rank's PID and start time, from its heartbeat."""
    beats = read_heartbeats(attempt / "heartbeats")
    if rank not in beats:
        raise ChaosTargetError(
            f"rank {rank}: expected a heartbeat in {attempt / 'heartbeats'}, found ranks "
            f"{sorted(beats)}. Wait until the ranks have started."
        )
    return beats[rank].pid, beats[rank].pid_started


def kill_rank(attempt: Path, rank: int) -> int:
    """SIGKILL one rank; return its PID."""
    pid, started = _rank_pid(attempt, rank)
    if not pids.signal_process(pid, started, signal.SIGKILL):
        raise _not_ours(f"rank {rank} (pid {pid})", attempt)
    _record(attempt, "crash", rank=rank, pid=pid)
    return pid


def slow_rank(attempt: Path, rank: int, factor: float, seconds: float) -> int:
    """Make one rank run ``factor`` times slower for ``seconds`` by freezing it part-time."""
    if factor <= 1:
        raise ChaosTargetError(f"--factor: expected a slowdown > 1, found {factor}")
    pid, started = _rank_pid(attempt, rank)
    if not pids.is_same_process(pid, started):
        raise _not_ours(f"rank {rank} (pid {pid})", attempt)
    _record(attempt, "straggler", rank=rank, pid=pid, factor=factor)
    running = SLOW_PERIOD_SECONDS / factor
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not pids.signal_process(pid, started, signal.SIGSTOP):
                log.warning("Rank %d (pid %d) ended while being slowed", rank, pid)
                break
            time.sleep(SLOW_PERIOD_SECONDS - running)
            pids.signal_process(pid, started, signal.SIGCONT)
            time.sleep(running)
    finally:
        pids.signal_process(pid, started, signal.SIGCONT)
    return pid
