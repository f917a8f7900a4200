"""Find the training processes a test left running (by their command line, never by name)."""

from __future__ import annotations

import threading
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
        if ("relay_train." in cmd or "relay.unattended" in cmd) and str(home) in cmd:
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


def write_heartbeat_for(beat: Path, seconds: float) -> threading.Thread:
    """Play a rank: rewrite ``beat`` every 0.05 s for ``seconds``, in a thread."""

    def write() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            beat.write_text("{}")
            time.sleep(0.05)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread
