"""A real 2-node run whose ranks use the spec's ``entrypoint.python`` (issue 29 item 7).

The interpreter is a second venv, made as ``relay spec venv`` makes it (layered on Relay's
environment, so it has torch and MLflow without a download). Two node agents, Relay's
own interpreter, start one rank each with that venv's ``bin/python``; the ranks train 10
steps over gloo and rank 0 publishes its checkpoints to MLflow from that venv. Once with
agents started for the launch, once with standby agents (preloaded in Relay's
interpreter, as a retry's are): a standby does not fork its ranks then either. What it
proves: each rank's ``sys.prefix`` is the second venv's (a fork of its agent would
have Relay's), its parent is its node agent running Relay's interpreter (the standby
itself when one was taken), and a package installed into the venv alone is importable
in the rank. What it does not: a venv with a torch of its own (that would be a download).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from processes import workload_processes

from relay.launchers.local.launcher import LocalLauncher
from relay.policy.model import Detection
from relay.tools.bench.common import Store, launch_config, watch
from relay.tools.rank_venv import make_rank_venv
from relay_train.agent.standby import ready_file
from relay_train.protocol import pids
from relay_train.protocol.launch import Entrypoint
from relay_train.protocol.manifest import CHECKPOINT_ROOT, step_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCRIPT = """\
import json, os, sys
import torch
import torch.distributed as dist
import relay_train
import venv_only_pkg  # installed into the second venv only

out = sys.argv[1]
session = relay_train.init()
session.init_process_group()
weights = torch.nn.Linear(2, 1)
session.track(weights=weights)
total = torch.zeros(1)
for step in session.steps():
    with session.collective():
        ones = torch.ones(1)
        dist.all_reduce(ones)
    total += ones
    session.report(step)
with open(f"/proc/{os.getppid()}/cmdline", "rb") as parent:
    agent = parent.read().split(b"\\0")
with open(os.path.join(out, f"rank-{session.rank}.json"), "w") as seen:
    json.dump({"prefix": sys.prefix, "executable": sys.executable, "parent": os.getppid(),
               "venv_only_pkg": venv_only_pkg.__file__, "total": total.item(),
               "agent": [part.decode() for part in agent[:3]]}, seen)
session.close()
"""
# The run ends by the ranks' exits; no start-up or hang threshold can fall due first.
DETECTION = Detection(startup_timeout=180.0, hang_timeout=120.0, heartbeat_timeout=60.0)


def _ready_standbys(launcher: LocalLauncher, directory: Path) -> None:
    """Start a standby agent on node-a and node-b; wait until both have preloaded."""
    launcher.warm_standbys(directory, ["node-a", "node-b"])
    deadline = time.monotonic() + 180
    while not all(ready_file(directory, n).exists() for n in ("node-a", "node-b")):
        assert time.monotonic() < deadline, "standbys never became ready"
        time.sleep(0.2)


def _stop_leftovers(home: Path) -> None:
    """Kill any agent, standby or rank of this test still running (by PID, start checked)."""
    for pid in workload_processes(home):
        pids.signal_process(pid, pids.start_time(pid), signal.SIGKILL)


@pytest.mark.parametrize("agents", ["fresh", "standby"])
def test_the_ranks_run_under_the_specs_venv(tmp_path: Path, agents: str) -> None:
    python = make_rank_venv(tmp_path / "venv", with_pip=False)
    site = next((tmp_path / "venv" / "lib").glob("python3.*/site-packages"))
    (site / "venv_only_pkg.py").write_text("")  # as `pip install` into the venv would
    (tmp_path / "train.py").write_text(SCRIPT)
    out = tmp_path / "seen"
    out.mkdir()
    store = Store(tmp_path / "mlflow")
    attempt_dir = tmp_path / "segment" / "try-1"  # a launch takes segment/standby's agents
    cfg = dataclasses.replace(
        launch_config(store, attempt_dir, steps=10, checkpoint_every=5),
        ranks_per_node=1, total_steps=10,
        entrypoint=Entrypoint(script=str(tmp_path / "train.py"), args=[str(out)],
                              python=str(python)))
    launcher = LocalLauncher()
    try:
        if agents == "standby":
            _ready_standbys(launcher, tmp_path / "segment" / "standby")
        attempt = launcher.launch(cfg)
        try:
            event = watch(cfg, DETECTION, timeout=300)
        finally:
            launcher.stop(attempt, grace_seconds=2.0)
    finally:
        _stop_leftovers(tmp_path)

    logs = {p.name: p.read_text()[-1500:] for p in (attempt_dir / "logs").glob("*")}
    assert event["status"] == "completed", (event, logs)
    seen: list[dict[str, Any]] = [json.loads((out / f"rank-{r}.json").read_text())
                                  for r in (0, 1)]
    handle = json.loads((attempt_dir / "handle.json").read_text())["nodes"]
    for node, rank in zip(("node-a", "node-b"), seen, strict=True):
        assert rank["prefix"] == str(tmp_path / "venv")  # the second venv, not Relay's
        assert rank["executable"] == str(python)
        assert rank["venv_only_pkg"] == str(site / "venv_only_pkg.py")
        assert rank["total"] == 20.0  # 10 steps of a 2-rank all_reduce of ones
        assert rank["agent"][:3] == [sys.executable, "-m", "relay_train.agent.node"], rank
        assert rank["parent"] == handle[node]["pid"]  # its node's agent started it
        if agents == "standby":
            assert "took over" in logs[f"agent-{node}.log"], logs
    # Rank 0 published its checkpoints with the venv's interpreter (MLflow from there too).
    published = {a.path for a in store.client.list_artifacts(cfg.run_id, CHECKPOINT_ROOT)}
    assert {step_dir(5), step_dir(10)} <= published, published
