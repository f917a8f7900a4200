"""Process trees from /proc: find a process's descendants and stop a set of PIDs for good.

Every signal goes through :mod:`relay_train.protocol.pids`, so a PID that exited and
was handed to another process while Relay waited is never signalled.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping
from pathlib import Path

from relay_train.protocol import pids


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Return whether ``pid`` runs and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """Return the live PIDs of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
                found.append(int(entry.name))
    return found


def descendants(root: int) -> list[int]:
    """Return every live descendant of ``root`` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return [p for p in found if alive(p)]


def stop_pids(procs: list[int], groups: list[int], grace: float,
              started: Mapping[int, int | None] | None = None) -> list[int]:
    """SIGTERM ``procs`` (and the process groups ``groups``), SIGKILL what outlives ``grace``.

    ``started`` holds the start time recorded for a PID or group leader (see
    :mod:`relay_train.protocol.pids`); any other is taken as it is now, found by the
    caller in /proc just before. A PID whose process is not that one any more is left
    alone. Frozen processes get SIGCONT so they can act on SIGTERM. Returns the PIDs given.
    """
    known = {p: pids.start_time(p) for p in {*procs, *groups}} | dict(started or {})
    # Once each: Airflow's components take a second SIGTERM as "exit now, skip clean-up".
    in_groups = {m for g in groups for m in group_members(g)}
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for pgid in groups:
            pids.signal_group(pgid, known[pgid], sig)
        for pid in procs:
            if pid not in in_groups:
                pids.signal_process(pid, known[pid], sig)
    deadline = time.monotonic() + grace
    while any(pids.is_running(p, known[p]) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pgid in groups:
        pids.signal_group(pgid, known[pgid], signal.SIGKILL)
    for pid in procs:
        if pids.is_running(pid, known[pid]):
            pids.signal_process(pid, known[pid], signal.SIGKILL)
    deadline = time.monotonic() + grace  # SIGKILL is not instant: wait for the kernel
    while any(pids.is_running(p, known[p]) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return procs
