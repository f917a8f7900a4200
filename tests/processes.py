"""Find the training processes a test left running (by their command line, never by name)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def workload_processes(home: Path) -> dict[int, str]:
    """Return the training processes (agents, ranks) and wardens started under ``home``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if ("relay_train." in cmd or "relay.recover.warden" in cmd) and str(home) in cmd:
            found[int(entry.name)] = cmd
    return found


def wait_exit(pid: int, timeout: float = 60) -> None:
    """Wait until ``pid`` has exited (or is a zombie), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except OSError:
            return
        time.sleep(0.1)


def write_heartbeat_for(beat: Path, seconds: float) -> None:
    """Play a rank that beats for ``seconds`` more: one write, dated ``seconds`` ahead.

    A watcher reads a heartbeat's age from its modification time, so this is fresh
    until then as a rank rewriting it every 0.05 s would be, without a writer thread
    that a busy CI machine could hold back past the watcher's idle limit."""
    beat.write_text("{}")
    until = time.time() + seconds
    os.utime(beat, (until, until))
