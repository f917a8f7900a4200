"""The demo's progress lines: attempts from Relay's records, states from the node agents."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from relay.launchers.base import LaunchStatus, NodeStatus, overall_state
from relay.tools.demo import ProgressPrinter
from relay_train.protocol.routes import NodeState

LAUNCH = {"start_step": 0, "end_step": 60, "nodes": ["node-a", "node-b"], "ranks_per_node": 2,
          "resume": None}
DECISION = {
    "fault": {"kind": "hang", "culprit_rank": 1, "culprit_node": "node-a",
              "evidence": {"summary": "rank 1 stalled"}},
    "decision": {"rule": "rules.hang", "action": "restart_elsewhere", "reason": "the 1st hang"},
    "lost_steps": 0, "drained_at_step": None,
    "rescued": {"rank": 0, "step": 35, "checkpoint": "runs:/abc/checkpoints/step-00000035"},
}


def _attempt(tmp_path: Path) -> Path:
    attempt = tmp_path / "relay_demo" / "run-1" / "segment-000" / "try-1"
    attempt.mkdir(parents=True)
    (attempt / "launch.json").write_text(json.dumps(LAUNCH))
    return attempt


def _status(printer: ProgressPrinter, state: NodeState) -> None:
    """Make the agents (as the channel would report them) say ``state``."""
    nodes = {n: NodeStatus(n, state) for n in LAUNCH["nodes"]}
    printer._status = lambda _attempt: LaunchStatus(overall_state(nodes), nodes)  # type: ignore[method-assign]


@pytest.mark.parametrize("early", [NodeState.STARTING, NodeState.RUNNING])
def test_a_fault_is_reported_after_agents_said_starting_or_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], early: NodeState
) -> None:
    attempt = _attempt(tmp_path)
    printer = ProgressPrinter(tmp_path / "relay_demo", 240, time.time())
    _status(printer, early)  # agents preloading: the attempt has not ended
    printer.poll()
    _status(printer, NodeState.FAILED)
    printer.poll()
    (attempt / "decision.json").write_text(json.dumps(DECISION))
    printer.poll()
    out = capsys.readouterr().out
    assert "segment_000 try 1: steps [0, 60) on node-a, node-b x 2 ranks, from scratch" in out
    assert "FAULT hang (rank 1, node-a): rank 1 stalled" in out
    assert "resumes at step 35: rank 0 handed over the state it held in memory" in out
