"""Relay signals only processes it started: a PID now held by another process is left alone."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agents import ServedAttempt

from relay.core.attempt import Attempt, AttemptState
from relay.launchers.local.launcher import HANDLE_FILE, LocalLauncher
from relay.tools import chaos
from relay_train.protocol import pids
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.heartbeat import Heartbeat, heartbeat_path, write_atomically
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated process in its own group, as if it had been given a PID Relay once used."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def stale_start(proc: subprocess.Popen[bytes]) -> int:
    """Return a start time that is not ``proc``'s: the one Relay recorded for the old owner."""
    started = pids.start_time(proc.pid)
    assert started is not None
    return started - 1


def still_running(proc: subprocess.Popen[bytes]) -> bool:
    time.sleep(0.2)
    return proc.poll() is None


def test_start_time_is_read_from_proc_and_none_for_a_reaped_pid() -> None:
    proc = subprocess.Popen(["true"])
    started = pids.start_time(proc.pid)
    proc.wait(timeout=10)
    assert isinstance(started, int)
    assert pids.start_time(proc.pid) is None
    assert not pids.is_running(proc.pid, started)


def test_signal_process_sends_only_to_the_recorded_process(
    stranger: subprocess.Popen[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="relay_train.protocol.pids"):
        assert not pids.signal_process(stranger.pid, stale_start(stranger), signal.SIGKILL)
        assert not pids.signal_group(stranger.pid, stale_start(stranger), signal.SIGKILL)
        assert not pids.signal_process(stranger.pid, None, signal.SIGKILL)
    assert still_running(stranger)
    assert "now belongs to another process" in caplog.text
    assert "no recorded start time" in caplog.text
    assert pids.signal_process(stranger.pid, pids.start_time(stranger.pid), signal.SIGKILL)
    stranger.wait(timeout=10)
    assert stranger.returncode == -signal.SIGKILL


def reused_attempt(root: Path, proc: subprocess.Popen[bytes]) -> Path:
    """An attempt whose node-a agent PID (and PGID) now belong to ``proc``."""
    root.mkdir(parents=True)
    handle = {"pid": proc.pid, "pgid": proc.pid, "started": stale_start(proc)}
    (root / HANDLE_FILE).write_text(json.dumps({"nodes": {"node-a": handle},
                                                "started_at": time.time()}))
    # The launch file, as the launcher wrote it: its channel secret is what Relay signs with.
    LaunchConfig(job="j", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=1,
                 checkpoint_every=1, nodes=["node-a"], ranks_per_node=1,
                 master_addr="127.0.0.1", master_port=1, tracking_uri="sqlite:///x", run_id="r",
                 attempt_dir=str(root), attempt=1, segment=0,
                 channel_secret=new_secret()).write(root / LAUNCH_FILE)
    return root


def test_stop_leaves_a_reused_pid_alone_and_logs_it(
    tmp_path: Path, stranger: subprocess.Popen[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    root = reused_attempt(tmp_path / "try-1", stranger)
    launcher = LocalLauncher()
    with caplog.at_level(logging.WARNING):
        assert launcher.stop(Attempt(root), grace_seconds=0.5) == []
    assert still_running(stranger)
    assert f"Leaving process group {stranger.pid} alone" in caplog.text
    # Nor does the reused PID make the dead agent look alive.
    assert launcher.status(Attempt(root)).state is AttemptState.FAILED


def test_chaos_refuses_targets_whose_pid_was_reused(
    tmp_path: Path, stranger: subprocess.Popen[bytes], request: pytest.FixtureRequest
) -> None:
    root = reused_attempt(tmp_path / "try-1", stranger)
    beat = Heartbeat(rank=0, node="node-a", pid=stranger.pid, pid_started=stale_start(stranger))
    (root / "heartbeats").mkdir()
    write_atomically(heartbeat_path(root / "heartbeats", 0), beat.to_json())
    agent = ServedAttempt(root, {"node-a": [0]})  # the node's agent reports that heartbeat
    request.addfinalizer(agent.close)
    handle = json.loads((root / HANDLE_FILE).read_text())
    handle["nodes"]["node-a"]["port"] = int(agent.addresses["node-a"].rsplit(":", 1)[1])
    (root / HANDLE_FILE).write_text(json.dumps(handle))
    with pytest.raises(chaos.ChaosTargetError, match="left alone"):
        chaos.kill_rank(root, 0)
    with pytest.raises(chaos.ChaosTargetError, match="left alone"):
        chaos.stop_node(root, "node-a")
    with pytest.raises(chaos.ChaosTargetError, match="left alone"):
        chaos.slow_rank(root, 0, factor=2.0, seconds=0.5)
    assert still_running(stranger)
    assert not (root / "chaos.jsonl").exists()


def test_heartbeat_records_the_writers_start_time(tmp_path: Path) -> None:
    import os

    from relay_train.protocol.heartbeat import HeartbeatWriter, read_heartbeats

    HeartbeatWriter(tmp_path, rank=3, node="n", interval_seconds=1.0).start().close()
    beat = read_heartbeats(tmp_path)[3]
    assert beat.pid == os.getpid()
    assert beat.pid_started == pids.start_time(os.getpid())
