"""`relay chaos`: break a running segment from outside, the way real faults do.

Stop every process of a node (SIGSTOP: the node goes silent), SIGKILL one
rank, or slow a rank by freezing it for part of every 500 ms. Each action is
appended to the attempt's ``chaos.jsonl`` with its time, like the in-rank
injector's, so detection latency can be measured the same way. Every signal
goes through the local launcher, which checks each PID's start time
(:mod:`relay_train.protocol.pids`): a target whose PID now belongs to another process is
left alone and the mismatch logged.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

from relay.core import settings
from relay.core.attempt import Attempt
from relay.core.exceptions import ChaosTargetError, NotOursError
from relay.launchers import launcher_from
from relay.launchers.local.launcher import HANDLE_FILE, LocalLauncher
from relay_train.protocol.injection import CHAOS_LOG

log = logging.getLogger(__name__)
# Freezes far longer than the scheduler's wake-up credit (a few ms): on a busy machine the
# CPU a rank lost in short freezes (of a 100 ms period) was mostly given back when it woke,
# so `--factor 3` slowed its compute only ~1.4x.
SLOW_PERIOD_SECONDS = 0.5


def _processes() -> LocalLauncher:
    """Return the launcher whose process groups `relay chaos` acts on: the local one."""
    launcher = launcher_from(None)
    if not isinstance(launcher, LocalLauncher):  # pragma: no cover - the factory's default
        raise ChaosTargetError("relay chaos acts on local process groups only")
    return launcher


def running_attempt(dag_id: str | None = None) -> Path:
    """Return the newest running segment attempt (of ``dag_id``, if given)."""
    base = settings.runs_dir() / dag_id if dag_id else settings.runs_dir()
    running = _processes().running_attempts(base)
    if running:
        return running[0].folder
    raise ChaosTargetError(
        f"no running segment attempt under {base}: expected a folder with {HANDLE_FILE} whose "
        "agents are running. Start a DAG run first, or pass --attempt-dir."
    )


def _record(attempt: Path, action: str, **details: object) -> None:
    entry = {"kind": action, "source": "relay chaos", "at": time.time(), **details}
    with (attempt / CHAOS_LOG).open("a") as fh:
        fh.write(json.dumps(entry) + "\n")


def _not_ours(exc: NotOursError, attempt: Path) -> ChaosTargetError:
    return ChaosTargetError(
        f"{exc.args[0]}: its recorded process is gone and the PID is not (or no longer) the "
        f"one {attempt} started, so it was left alone. Pick a running attempt.")


def _signal_node(attempt: Path, node: str, sig: signal.Signals) -> int:
    try:
        return _processes().signal_node(Attempt(attempt), node, sig)
    except NotOursError as exc:
        raise _not_ours(exc, attempt) from exc
    except KeyError as exc:
        raise ChaosTargetError(exc.args[0]) from exc


def stop_node(attempt: Path, node: str) -> int:
    """SIGSTOP every process of ``node`` (its agent and its ranks); return the PGID."""
    at = time.time()
    pgid = _signal_node(attempt, node, signal.SIGSTOP)
    _record(attempt, "stop_node", node=node, pgid=pgid, at=at)
    log.warning("Stopped every process of %s (process group %d)", node, pgid)
    return pgid


def continue_node(attempt: Path, node: str) -> int:
    """SIGCONT every process of ``node`` (undo :func:`stop_node`)."""
    return _signal_node(attempt, node, signal.SIGCONT)


def _rank_pid(attempt: Path, rank: int) -> int:
    """Return the rank's PID, from its heartbeat, if it is still that rank's process."""
    try:
        pid = _processes().rank_pid(Attempt(attempt), rank)
    except NotOursError as exc:
        raise _not_ours(exc, attempt) from exc
    if pid is None:
        raise ChaosTargetError(
            f"rank {rank}: expected a heartbeat from its node's agent for {attempt}, found "
            "none. Wait until the ranks have started."
        )
    return pid


def kill_rank(attempt: Path, rank: int) -> int:
    """SIGKILL one rank; return its PID."""
    pid = _rank_pid(attempt, rank)
    at = time.time()
    try:
        _processes().signal_rank(Attempt(attempt), rank, signal.SIGKILL)
    except NotOursError as exc:
        raise _not_ours(exc, attempt) from exc
    _record(attempt, "crash", rank=rank, pid=pid, at=at)
    return pid


def slow_rank(attempt: Path, rank: int, factor: float, seconds: float) -> int:
    """Make one rank run ``factor`` times slower for ``seconds`` by freezing it part-time."""
    if factor <= 1:
        raise ChaosTargetError(f"--factor: expected a slowdown > 1, found {factor}")
    pid = _rank_pid(attempt, rank)
    _record(attempt, "straggler", rank=rank, pid=pid, factor=factor)
    if not _processes().throttle_rank(Attempt(attempt), rank, 1 / factor, SLOW_PERIOD_SECONDS,
                                      seconds):
        log.warning("Rank %d (pid %d) ended while being slowed", rank, pid)
    return pid
