"""Processes of the test bed, known by PID and start time, stopped with their children
(through :mod:`relay.core.proctree`), and the setup commands it runs."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from relay.core import proctree
from relay_train.protocol import pids

start_time = pids.start_time  # with the PID, names one process and no later one
alive = pids.is_running


def stop(pid: int, started: int | None, grace: float = 5.0, term: bool = True) -> bool:
    """Stop the process named by (pid, start time) and everything below it (SIGTERM, then
    SIGKILL after ``grace``; SIGKILL at once when not ``term``); return False when it was
    already gone. Raises OSError when something outlives SIGKILL by ``grace``.
    """
    if not alive(pid, started):
        return False
    tree = {p: start_time(p) for p in proctree.descendants(pid)} | {pid: started}
    if term:
        proctree.stop_pids(list(tree), [], grace, started=tree)
    else:
        for target, began in tree.items():
            pids.signal_process(target, began, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while any(alive(p, began) for p, began in tree.items()) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [p for p, began in tree.items() if alive(p, began)]
    if left:
        raise OSError(f"processes {left} outlived SIGKILL by {grace:.0f} s")
    return True


def run(cmd: list[str], what: str) -> str:
    """Run a setup command; raise RuntimeError naming ``what`` and its stderr when it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what}: `{' '.join(cmd)}` exited {done.returncode}: "
                           f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def in_pid_namespace(member: int) -> list[int]:
    """Return every process in the PID namespace of ``member`` (as seen from here).

    Daemons started on a host through `nsenter` are in its PID namespace but not below its
    `unshare` process: this finds them.
    """
    try:
        target = os.readlink(f"/proc/{member}/ns/pid")
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == target:
                    found.append(int(entry))
            except OSError:
                continue
    return found
