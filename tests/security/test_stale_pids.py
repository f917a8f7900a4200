"""A recorded PID that names another process now is never signalled, nor its group.

`relay services down` / `restart` signal the PIDs `up` recorded in services.json,
with their process groups and descendants. After a crash or a reboot those PIDs
may be strangers'. Here a real "stranger" (a process with a child, leading its
own group, as Airflow's components do) is recorded with a wrong start time, or
under another boot, and the real command runs; the stranger must live on. The
same record with the right start time must stop it: the path does reach it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import wait_exit

from relay.core.proctree import alive, descendants
from relay.core.settings import REPO_ROOT
from relay.tools import pgcluster, services
from relay.tools.deployment import Deployment, Ports, record, state_file
from relay_train.protocol.pids import boot_id, start_time

STRANGER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print("ready", flush=True)
time.sleep(300)
"""


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A process not started by Relay, leading its own group, with a child in it."""
    proc = subprocess.Popen([sys.executable, "-c", STRANGER], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    try:
        yield proc
    finally:
        if proc.poll() is None:  # not reaped yet: its PID and group id are still its own
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _record(home: Path, pid: int, started: int | None, boot: str | None) -> None:
    state_file(home).parent.mkdir(parents=True, exist_ok=True)
    record(Deployment(str(home), Ports(0, 0, 0, 0), {"scheduler": pid}, 0.0,
                      started={"scheduler": started}, boot=boot))


def _services_down(home: Path) -> subprocess.CompletedProcess[str]:
    """Run the real `relay services down` against ``home``."""
    return subprocess.run([str(Path(sys.executable).with_name("relay")), "services", "down"],
                          env={**os.environ, "RELAY_HOME": str(home)}, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize("case", ["wrong start time", "no start time", "another boot"])
def test_services_down_leaves_a_stranger_with_a_recorded_pid_alone(
    case: str, stranger: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    child = descendants(stranger.pid)
    assert len(child) == 1
    real = start_time(stranger.pid)
    assert real is not None
    started, boot = {"wrong start time": (real + 1, boot_id()),
                     "no start time": (None, boot_id()),
                     "another boot": (real, "another-boot")}[case]
    _record(tmp_path, stranger.pid, started, boot)

    done = _services_down(tmp_path)

    assert done.returncode == 0, done.stderr
    assert "Not stopping scheduler" in done.stderr
    assert stranger.poll() is None and alive(stranger.pid), "a stranger was signalled"
    assert alive(child[0]), "a stranger's child was signalled"
    assert not state_file(tmp_path).exists()


def test_services_down_stops_the_recorded_process_when_it_is_still_ours(
    stranger: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    child = descendants(stranger.pid)
    _record(tmp_path, stranger.pid, start_time(stranger.pid), boot_id())

    done = _services_down(tmp_path)

    assert done.returncode == 0, done.stderr
    assert stranger.wait(timeout=60) == -signal.SIGTERM
    wait_exit(child[0])
    assert not alive(child[0])


def test_restart_leaves_a_stranger_alone_and_records_the_new_process(
    stranger: subprocess.Popen[bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[bytes]] = []

    def start(home: Path, ports: Ports, name: str, env: dict[str, str]) -> int:
        # Instead of a real scheduler: the signalling path is what is under test.
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                        start_new_session=True))
        return started[-1].pid

    monkeypatch.setattr(services, "_start", start)
    _record(tmp_path, stranger.pid, start_time(stranger.pid) + 1, boot_id())
    try:
        pid = services.restart("scheduler", tmp_path, grace=1.0)
        assert stranger.poll() is None and alive(stranger.pid)
        assert all(alive(c) for c in descendants(stranger.pid))
        after = services.read_deployment(tmp_path)
        assert after is not None and after.pids["scheduler"] == pid
        assert after.started["scheduler"] == start_time(pid) and after.running("scheduler")
    finally:
        for proc in started:
            proc.kill()
            proc.wait(timeout=30)


def test_postgres_is_not_stopped_through_a_stale_pid(stranger: subprocess.Popen[bytes]) -> None:
    real = start_time(stranger.pid)
    assert real is not None
    assert pgcluster.stop(stranger.pid, real + 1, grace=1.0) is False
    assert stranger.poll() is None


# Raw signalling calls allowed: the start-time-checked functions themselves, and a rank
# freezing its own process group (a chaos fault it injects into itself).
RAW_SIGNAL = re.compile(r"\bos\.(kill|killpg)\b|\.send_signal\(")
ALLOWED = {
    "training/protocol/pids.py": 2,  # os.kill and os.killpg, handed to its one _send
    "training/inject.py": 3,  # os.kill(os.getpid(), ...) twice, os.killpg(own, ...)
}


def test_every_pid_is_signalled_through_the_start_time_check() -> None:
    found: dict[str, int] = {}
    for folder in ("plugins", "training", "dags", "scripts"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            count = len(RAW_SIGNAL.findall(path.read_text()))
            if count:
                found[str(path.relative_to(REPO_ROOT))] = count
    assert found == ALLOWED, ("signal a recorded PID through relay_train.protocol.pids "
                              "(signal_process / signal_group) instead")
    inject = (REPO_ROOT / "training" / "inject.py").read_text()
    assert all(m.group(0) in ("os.kill(os.getpid(),", "os.killpg(own,")
               for m in re.finditer(r"os\.kill(pg)?\([^,]+,", inject))
