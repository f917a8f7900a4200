"""The standby handshake: take, hand over, release, expire (no training here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relay.launchers.local.launcher import LocalLauncher, group_members
from relay_train.agent.standby import (
    announce_ready,
    hand_over,
    ready_file,
    standby_file,
    taken_file,
    wait_for_launch,
)
from relay_train.protocol.pids import start_time


class Standby(threading.Thread):
    """A standby agent's waiting half, in a thread of this process (so its PID is alive)."""

    def __init__(self, directory: Path, node: str, ttl: float = 30.0) -> None:
        super().__init__(daemon=True)
        self.directory, self.node, self.ttl = directory, node, ttl
        self.result: Path | None | str = "not yet"
        standby_file(directory, node).write_text(
            f'{{"pid": {os.getpid()}, "started": {start_time(os.getpid())}}}')

    def run(self) -> None:
        announce_ready(self.directory, self.node, 0.1)
        self.result = wait_for_launch(self.directory, self.node, self.ttl, poll=0.01)


def test_a_taken_standby_gets_the_launch_file(tmp_path: Path) -> None:
    standby = Standby(tmp_path, "node-c")
    standby.start()
    pid = LocalLauncher._take(tmp_path, "node-c", tmp_path / "launch.json", wait_seconds=10)
    standby.join(10)
    assert pid == os.getpid()
    assert standby.result == tmp_path / "launch.json"
    assert not standby_file(tmp_path, "node-c").exists()  # taken: release leaves it alone
    assert not ready_file(tmp_path, "node-c").exists()
    assert not taken_file(tmp_path, "node-c").exists()


def test_taking_waits_for_a_standby_still_preloading(tmp_path: Path) -> None:
    standby = Standby(tmp_path, "node-c")
    threading.Timer(0.5, standby.start).start()  # ready only half a second from now
    pid = LocalLauncher._take(tmp_path, "node-c", tmp_path / "launch.json", wait_seconds=10)
    standby.join(10)
    assert pid == os.getpid() and standby.result == tmp_path / "launch.json"


def test_no_standby_means_a_cold_start(tmp_path: Path) -> None:
    assert LocalLauncher._take(tmp_path, "node-c", tmp_path / "launch.json", 0.2) is None


def test_a_released_standby_leaves(tmp_path: Path) -> None:
    standby = Standby(tmp_path, "node-c")
    standby.start()
    while not ready_file(tmp_path, "node-c").exists():
        time.sleep(0.01)
    ready_file(tmp_path, "node-c").rename(taken_file(tmp_path, "node-c"))
    hand_over(tmp_path, "node-c", None)
    standby.join(10)
    assert standby.result is None


def test_an_untaken_standby_withdraws_after_its_ttl(tmp_path: Path) -> None:
    standby = Standby(tmp_path, "node-c", ttl=0.3)
    standby.start()
    standby.join(10)
    assert standby.result is None
    assert not ready_file(tmp_path, "node-c").exists()
    # Too late: a launcher finds nothing to take and starts the node cold.
    assert LocalLauncher._take(tmp_path, "node-c", tmp_path / "launch.json", 0.2) is None


@pytest.mark.parametrize("taken", [True, False])
def test_release_forgets_every_untaken_standby(tmp_path: Path, taken: bool) -> None:
    standby_file(tmp_path, "node-d").write_text('{"pid": 999999999}')  # long gone
    ready_file(tmp_path, "node-d").write_text("{}")
    if taken:
        ready_file(tmp_path, "node-d").rename(taken_file(tmp_path, "node-d"))
    LocalLauncher.release_standbys(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


_FORKING_ATTEMPT = """
import os, sys, time
from relay_train.agent.standby import fork_detached
pid = fork_detached()
if pid == 0:
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""


def test_a_detached_fork_survives_its_parents_group_stopped_at_once() -> None:
    """What a launcher does to a faulty attempt right after asking its agent for a standby:
    the standby has left the attempt's group by the time the agent reports its PID."""
    attempt = subprocess.Popen([sys.executable, "-c", _FORKING_ATTEMPT],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = 0
    try:
        assert attempt.stdout is not None
        child = int(attempt.stdout.readline())
        os.killpg(attempt.pid, signal.SIGKILL)
        attempt.wait(timeout=30)
        assert group_members(child) == [child], "stopping the parent's group took the child"
        assert os.getsid(child) == child
    finally:
        if child:
            os.kill(child, signal.SIGKILL)
        if attempt.poll() is None:
            os.killpg(attempt.pid, signal.SIGKILL)
            attempt.wait()
