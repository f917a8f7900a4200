"""Stopping a process tree by PID: children found through /proc, SIGTERM-deaf ones killed."""

from __future__ import annotations

import subprocess
import sys
import time

from relay.core.proctree import alive, descendants, group_members, stop_pids

TREE = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # like a LocalExecutor worker
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print("ready", flush=True)
time.sleep(120)
"""


def test_stop_pids_reaches_children_in_other_sessions_and_sigterm_deaf_parents() -> None:
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert root.stdout is not None and root.stdout.readline().strip() == b"ready"
    kids = descendants(root.pid)
    assert len(kids) == 1
    assert root.pid in group_members(root.pid) and kids[0] not in group_members(root.pid)
    stop_pids([root.pid, *kids], groups=[root.pid], grace=1.0)
    root.wait(timeout=10)
    deadline = time.monotonic() + 5
    while alive(kids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(kids[0]) and not alive(root.pid)
