"""A script that returns before its segment's end, in a real 2-node run (issue 29 item 2).

Two node agents fork one rank each (real torch.distributed over gloo); the real segment
watcher watches them. Rank 1's script leaves its loop after 3 of the segment's 10 steps
and returns cleanly: the attempt faults ``short_segment`` naming rank 1, the step it
reached and the step expected, and the default policy aborts. The same script run to
the end completes. Both runs check what the session told the script: the job's
``total_steps``, not the segment's end.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

import relay.core.settings
from relay.core.faults import Fault, FaultKind
from relay.policy.decide import decide
from relay.policy.model import Detection, load_policy
from relay.tools.bench.common import Store, launch_config, launched, watch
from relay_train.protocol.launch import SHORT_SEGMENT_EXIT, Entrypoint, parse_short_segment

pytestmark = pytest.mark.integration

SCRIPT = """\
import json, os, sys
import torch
import torch.distributed as dist
import relay_train

out, leave_after = sys.argv[1], int(sys.argv[2])  # rank 1 leaves after this many steps
session = relay_train.init()
session.init_process_group()
with open(os.path.join(out, f"rank-{session.rank}.json"), "w") as seen:
    json.dump({"total_steps": session.total_steps, "end_step": session.end_step,
               "env": os.environ["RELAY_TOTAL_STEPS"]}, seen)
for step in session.steps():
    with session.collective():
        dist.all_reduce(torch.ones(1))
    session.report(step)
    if session.rank == 1 and step + 1 == leave_after:
        break  # a clean return, long before the segment's end
session.close()
"""
# No hang or start-up threshold can fall due before the exits are seen, however slow the
# machine: the run ends by its exit codes, or not at all.
DETECTION = Detection(startup_timeout=120.0, hang_timeout=120.0, heartbeat_timeout=60.0)


def _run(tmp_path: Path, leave_after: int) -> tuple[dict[str, Any], Path]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "seen"
    out.mkdir()
    cfg = dataclasses.replace(
        launch_config(Store(tmp_path / "mlflow"), tmp_path / "attempt", steps=10),
        ranks_per_node=1, total_steps=40,
        entrypoint=Entrypoint(script=str(script), args=[str(out), str(leave_after)]))
    with launched(cfg):
        event = watch(cfg, DETECTION, timeout=180)
    return event, out


def _told(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


def test_a_script_that_returns_early_faults_short_segment_and_is_aborted(
    tmp_path: Path,
) -> None:
    event, out = _run(tmp_path, leave_after=3)

    assert event["status"] == "faulted", event
    fault = Fault.from_event(event["fault"])
    assert (fault.kind, fault.culprit_rank, fault.culprit_node) == (
        FaultKind.SHORT_SEGMENT, 1, "node-b"), fault
    assert (fault.evidence["step"], fault.evidence["expected_step"]) == (3, 10), fault
    assert {str(r): c for r, c in fault.evidence["exit_codes"].items()}["1"] == SHORT_SEGMENT_EXIT
    summary = fault.evidence["summary"]
    assert "rank 1's script returned cleanly at step 3" in summary
    assert "expected it to train to step 10" in summary
    # The rank's own log says it too, last.
    log = (tmp_path / "attempt" / "logs" / "rank-1.log").read_text()
    assert parse_short_segment(log.strip().splitlines()[-1]) == (1, 3, 10), log[-2000:]

    default = load_policy(Path(relay.core.settings.REPO_ROOT) / "policies" / "default.yaml")
    decision = decide(fault, [], default.policy, default.sha256)
    assert (decision.action, decision.retry) == ("abort", False)
    assert decision.rule == "rules.short_segment"
    assert _told(out) == [{"total_steps": 40, "end_step": 10, "env": "40"}] * 2


def test_the_same_script_run_to_its_segment_end_completes(tmp_path: Path) -> None:
    event, out = _run(tmp_path, leave_after=0)  # never leaves

    assert event["status"] == "completed", event
    assert _told(out) == [{"total_steps": 40, "end_step": 10, "env": "40"}] * 2
