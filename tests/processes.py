"""Find the training processes a test left running (by their command line, never by name)."""

from __future__ import annotations

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
