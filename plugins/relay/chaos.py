"""`relay chaos`: break a running segment from outside, the way real faults do.

Stop every process of a node (SIGSTOP: the node goes silent), SIGKILL one
rank, or slow a rank by freezing it for part of every 100 ms. Each action is
appended to the attempt's ``chaos.jsonl`` with its time, like the in-rank
injector's, so detection latency can be measured the same way.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

from relay import settings
from relay.launchers.local import HANDLE_FILE, LaunchState, LocalLauncher
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


def stop_node(attempt: Path, node: str) -> int:
    """SIGSTOP every process of ``node`` (its agent and its ranks); return the PGID."""
    handle = json.loads((attempt / HANDLE_FILE).read_text())["nodes"]
    if node not in handle:
        raise ChaosTargetError(f"node {node!r}: expected one of {sorted(handle)} in {attempt}")
    pgid = int(handle[node]["pgid"])
    _record(attempt, "stop_node", node=node, pgid=pgid)
    os.killpg(pgid, signal.SIGSTOP)
    log.warning("Stopped every process of %s (process group %d)", node, pgid)
    return pgid


def continue_node(attempt: Path, node: str) -> int:
    """SIGCONT every process of ``node`` (undo :func:`stop_node`)."""
    pgid = int(json.loads((attempt / HANDLE_FILE).read_text())["nodes"][node]["pgid"])
    os.killpg(pgid, signal.SIGCONT)
    return pgid


def _rank_pid(attempt: Path, rank: int) -> int:
    beats = read_heartbeats(attempt / "heartbeats")
    if rank not in beats:
        raise ChaosTargetError(
            f"rank {rank}: expected a heartbeat in {attempt / 'heartbeats'}, found ranks "
            f"{sorted(beats)}. Wait until the ranks have started."
        )
    return beats[rank].pid


def kill_rank(attempt: Path, rank: int) -> int:
    """SIGKILL one rank; return its PID."""
    pid = _rank_pid(attempt, rank)
    _record(attempt, "crash", rank=rank, pid=pid)
    os.kill(pid, signal.SIGKILL)
    return pid


def slow_rank(attempt: Path, rank: int, factor: float, seconds: float) -> int:
    """Make one rank run ``factor`` times slower for ``seconds`` by freezing it part-time."""
    if factor <= 1:
        raise ChaosTargetError(f"--factor: expected a slowdown > 1, found {factor}")
    pid = _rank_pid(attempt, rank)
    _record(attempt, "straggler", rank=rank, pid=pid, factor=factor)
    running = SLOW_PERIOD_SECONDS / factor
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(SLOW_PERIOD_SECONDS - running)
            os.kill(pid, signal.SIGCONT)
            time.sleep(running)
    except ProcessLookupError:
        log.warning("Rank %d (pid %d) ended while being slowed", rank, pid)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    return pid
