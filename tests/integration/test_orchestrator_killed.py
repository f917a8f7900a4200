"""Nothing outlives its run: a real resident agent leaves once the run's orchestrator is killed.

The orchestrator is played by a process that renews the run's lease (as the watcher's polls
do); it is SIGKILLed, and the resident, which no heartbeat idles out for ten minutes, must
leave on its own. Generous waits on the events, no speed asserted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay.core.proctree import group_members
from relay.launchers.local.launcher import LocalLauncher
from relay.launchers.local.warm_agents import recorded_pid, release_run
from relay_train.agent.resident import IDLE_CHECK_SECONDS, IDLE_SECONDS, RESIDENT_DIR
from relay_train.protocol.run_lease import LEASE_FILE

pytestmark = pytest.mark.integration

RENEW = """\
import sys, time
from pathlib import Path
from relay_train.protocol.run_lease import renew
while True:
    renew(Path(sys.argv[1]), 2.0, by="test orchestrator")
    time.sleep(0.2)
"""


def _wait(predicate: object, seconds: float, why: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


# A real resident, preloading or preloaded (it checks the lease either way): ~15 s.
def test_a_resident_leaves_once_its_runs_orchestrator_is_killed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    orchestrator = subprocess.Popen([sys.executable, "-c", RENEW, str(run)],
                                    start_new_session=True)
    resident_pid = None
    try:
        _wait(lambda: (run / LEASE_FILE).exists(), 60, "the orchestrator never renewed")
        LocalLauncher().reside(run, ["node-c"])
        directory = run / RESIDENT_DIR
        resident_pid = recorded_pid(directory, "node-c")
        assert resident_pid is not None
        time.sleep(IDLE_CHECK_SECONDS + 1)  # a lease check or more while it is renewed
        assert group_members(resident_pid), "the resident left while its run was orchestrated"
        os.killpg(orchestrator.pid, signal.SIGKILL)
        orchestrator.wait()
        assert IDLE_SECONDS > 300  # so only the lapsed lease can end it within the wait below
        _wait(lambda: not group_members(resident_pid), 120,
              "the resident outlived its killed orchestrator")
    finally:
        if orchestrator.poll() is None:
            os.killpg(orchestrator.pid, signal.SIGKILL)
            orchestrator.wait()
        release_run(run)  # stops the resident by its recorded PID, if it is still there
