"""Signal only the processes Relay started: every PID is checked against its start time.

A stored PID (a node agent, a rank, a standby agent, a chaos target) can be
reused by an unrelated process after the original exits, a reboot or a long
pause. So every handle records the process's start time (``/proc/PID/stat``
field 22, clock ticks since boot; unique per PID for as long as the machine
is up), and :func:`signal_process` / :func:`signal_group` send a signal only
when the process is still the one that was recorded. A mismatch is logged
and left alone. Stdlib only: both the worker side and Relay import it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

_START_TIME_FIELD = 22  # in /proc/PID/stat, 1-based, see proc(5)


def _stat_fields(pid: int) -> list[str] | None:
    """Return ``/proc/PID/stat`` from field 3 (state) on, or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    return text.rsplit(")", 1)[1].split()  # the name (field 2) may hold spaces and ")"


def start_time(pid: int) -> int | None:
    """Return when ``pid`` started (clock ticks since boot), or None if it does not exist."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    try:
        return int(fields[_START_TIME_FIELD - 3])
    except (IndexError, ValueError):
        return None


def boot_id() -> str | None:
    """Return this boot's id (``/proc/sys/kernel/random/boot_id``), or None where unreadable.

    Start times count from boot, so a record kept across a reboot (a state file on disk)
    also keeps the boot it was made in: another boot's PIDs are all strangers'.
    """
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def is_same_process(pid: int, started: int | None) -> bool:
    """Return whether ``pid`` is still the process that started at ``started``."""
    return started is not None and start_time(pid) == started


def is_running(pid: int, started: int | None) -> bool:
    """Return whether the recorded process still runs (not a zombie, not a reused PID)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z" and is_same_process(pid, started)


def group_is_ours(pgid: int, leader_started: int | None) -> bool:
    """Return whether process group ``pgid`` may be the one whose leader was recorded.

    True when the leader is the recorded process, or has exited: Linux never hands
    out a PID still in use as a process group id, so members left behind by an
    exited leader (orphaned ranks) are still ours.
    """
    return start_time(pgid) is None or is_same_process(pgid, leader_started)


def _refuse(what: str, pid: int, started: int | None, sig: int) -> bool:
    now = start_time(pid)
    if now is None:
        log.info("Not sending signal %d to %s %d: it has exited", sig, what, pid)
    elif started is None:
        log.warning("Not sending signal %d to %s %d: its handle has no recorded start time, so "
                    "it may be another process that reused the PID", sig, what, pid)
    else:
        log.warning("Not sending signal %d to %s %d: the PID now belongs to another process "
                    "(started at tick %d, recorded %d)", sig, what, pid, now, started)
    return False


def signal_process(pid: int, started: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` if it is the recorded process; return whether it was sent."""
    return _send(os.kill, "process", pid, started, sig, is_same_process(pid, started))


def signal_group(pgid: int, leader_started: int | None, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid`` if it is still the group Relay started."""
    return _send(os.killpg, "process group", pgid, leader_started, sig,
                 group_is_ours(pgid, leader_started))


def _send(kill: Callable[[int, int], None], what: str, pid: int, started: int | None,
          sig: int, ours: bool) -> bool:
    if not ours:
        return _refuse(what, pid, started, sig)
    try:
        kill(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: never one Relay started
        log.warning("Not allowed to send signal %d to %s %d", sig, what, pid)
        return False
    return True
