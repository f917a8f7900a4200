"""Process trees from /proc: find a process's descendants and stop a set of PIDs for good."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


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


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_pids(pids: list[int], groups: list[int], grace: float) -> list[int]:
    """SIGTERM ``pids`` (and the process groups ``groups``), SIGKILL what outlives ``grace``.

    Frozen processes get SIGCONT so they can act on SIGTERM. Returns the PIDs signalled.
    """
    # Once each: Airflow's components take a second SIGTERM as "exit now, skip clean-up".
    in_groups = {m for g in groups for m in group_members(g)}
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for pgid in groups:
            _signal(pgid, sig, group=True)
        for pid in pids:
            if pid not in in_groups:
                _signal(pid, sig)
    deadline = time.monotonic() + grace
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pgid in groups:
        _signal(pgid, signal.SIGKILL, group=True)
    for pid in pids:
        if alive(pid):
            _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace  # SIGKILL is not instant: wait for the kernel
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids
