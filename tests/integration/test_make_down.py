"""`make down` stops what an interrupted DAG run left training: its agents, ranks and standbys.

They run in sessions of their own (a node's processes are one process group), so
stopping Airflow's processes leaves them training, unwatched, holding the CPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from relay.launchers.local.adopt import STOPPED_FILE
from relay.launchers.local.launcher import STANDBY_DIR, LocalLauncher
from relay.tools import services
from relay.tools.bench.common import Store, launch_config, launched
from relay_train.agent.standby import ready_file
from relay_train.protocol.heartbeat import read_heartbeats

pytestmark = pytest.mark.integration


def _until(what: str, check: object, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_stop_workloads_stops_a_running_attempt_and_an_untaken_standby(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run_dir = runs / "relay_demo" / "manual__1"
    cfg = launch_config(Store(tmp_path / "mlflow"), run_dir / "segment-000" / "try-1",
                        steps=100_000)
    standbys = run_dir / "segment-001" / STANDBY_DIR
    finished = run_dir / "segment-000" / "try-0"  # an earlier attempt, long gone: left alone
    finished.mkdir(parents=True)
    (finished / "handle.json").write_text('{"nodes": {"node-a": {"pid": 999999999, '
                                          '"pgid": 999999999, "started": 1, "port": null}}}')
    launcher = LocalLauncher()
    with launched(cfg) as attempt:
        root = attempt.folder
        launcher.warm_standbys(standbys, ["node-c"])
        _until("every rank stepping", lambda: len(read_heartbeats(root / "heartbeats")) == 4)
        _until("the standby preloaded", lambda: ready_file(standbys, "node-c").exists())
        assert launcher.has_processes(attempt)

        survivors = services.stop_workloads(runs)

        assert survivors == []
        assert not launcher.has_processes(attempt)
        assert (root / STOPPED_FILE).exists(), "a stopped attempt must never be adopted"
        assert not (finished / STOPPED_FILE).exists()
        assert not list(standbys.glob("*.standby"))
