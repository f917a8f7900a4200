"""The spec's entrypoint.python: the agent starts the rank with that interpreter (not a
fork of its own). Its preflight: tests/unit/spec/test_rank_python.py."""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import sys
from pathlib import Path

from relay_train.agent.node import NodeAgent
from relay_train.agent.ranks import stop_ranks
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.interpreter import PATH_FOLDER
from relay_train.protocol.launch import LAUNCH_FILE, Entrypoint, LaunchConfig

# What the rank's script records: the wrapper's mark, and where relay_train came from.
SCRIPT = """\
import json, os, sys
import relay_train
with open(os.environ["RELAY_TEST_OUT"], "w") as out:
    json.dump({"mark": os.environ.get("RELAY_TEST_INTERPRETER"),
               "relay_train": relay_train.__file__, "cwd": os.getcwd()}, out)
"""


def wrapper_interpreter(folder: Path) -> Path:
    """Return an interpreter that marks its environment, then runs this Python."""
    wrapper = folder / "python-wrapper"
    wrapper.write_text("#!/bin/sh\nexport RELAY_TEST_INTERPRETER=wrapped\n"
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_the_rank_runs_under_the_specs_interpreter(tmp_path: Path) -> None:
    root = tmp_path / "attempt"
    root.mkdir()
    (tmp_path / "train.py").write_text(SCRIPT)
    out = tmp_path / "out.json"
    entry = Entrypoint(script=str(tmp_path / "train.py"), python=str(wrapper_interpreter(tmp_path)),
                       env={"RELAY_TEST_OUT": str(out)})
    cfg = LaunchConfig(job="interp", seed=0, model={}, data={}, optimizer={}, start_step=0,
                       end_step=1, checkpoint_every=1, nodes=["node-a"], ranks_per_node=1,
                       tracking_uri="", run_id="", attempt_dir=str(root), attempt=0, segment=0,
                       channel_secret=new_secret(), backend="gloo", entrypoint=entry)
    cfg.write(root / LAUNCH_FILE)
    agent = NodeAgent(cfg, root / LAUNCH_FILE, "node-a")
    assert agent.preload() == 0.0  # nothing to fork from: nothing preloaded
    try:
        agent.start_ranks()
        rank = agent.procs[0]
        assert rank.pid != os.getpid()
        multiprocessing.connection.wait([rank.sentinel], timeout=120)
        assert rank.exitcode == 0, (root / "logs" / "rank-0.log").read_text()
    finally:
        stop_ranks(list(agent.procs.values()), "the test is over")
    seen = json.loads(out.read_text())
    assert seen["mark"] == "wrapped"  # started by the wrapper, not forked from this process
    assert seen["relay_train"] == str(root / PATH_FOLDER / "relay_train" / "__init__.py")
    assert seen["cwd"] == str(root)
