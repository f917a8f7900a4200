"""Lightning and Hugging Face ``Trainer`` scripts under Relay, end to end.

The scripts are ``training/examples/lightning_gpt2.py`` and ``hf_gpt2.py``: a plain
script plus :mod:`relay_train.lightning` or :mod:`relay_train.hf`'s callback (three
lines). Each trains a 2-layer GPT-2 built from a config (nothing downloaded) on
random tokens, through `airflow dags test` with real MLflow and 4-rank DDP over gloo,
and recovers from a stalled rank and from a frozen node: the culprit named, the
state rescued from a healthy rank (0 lost steps), the job finished. The plain scripts
the worker API page diffs against run under ``torchrun``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from airflow_jobs import fault_records, final_state, free_the_pool, run_job, use_jobs
from processes import workload_processes

from relay.core.settings import REPO_ROOT
from relay.lineage.run_view import run_view
from relay.lineage.store import Lineage

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # `make test-slow`: minutes each

EXAMPLES = REPO_ROOT / "training" / "examples"
JOB = """\
job: {name}
total_steps: 60
steps_per_segment: 20
checkpoint_every: 5
nodes: 2
ranks_per_node: 2
entrypoint: {{script: "{script}", args: {args}}}
policy: ../policies/callbacks.yaml
retries: 3
retry_delay: 1s
chaos: allowed
"""
# Four ranks importing transformers at once on a loaded 2-core machine starve the node
# agents for seconds: the default 2 s heartbeat timeout would call a busy node frozen.
POLICY = """\
version: 1
detection:
  heartbeat_timeout: 15s
  hang_timeout: 20s
  startup_timeout: 5m
  straggler: null
  throughput: null
rules:
  hang:                {action: restart_elsewhere, max_attempts: 3, quarantine: 30m}
  rank_unresponsive:   {action: restart_elsewhere, max_attempts: 3, quarantine: 30m}
  node_unresponsive:   {action: restart_elsewhere, max_attempts: 3, quarantine: 1h}
  straggler:           {action: checkpoint_and_migrate, quarantine: 30m}
  throughput_degraded: {action: checkpoint_and_migrate}
  crash:               {action: retry}
  launch_failure:      {action: restart_elsewhere, quarantine: 15m}
  nan_loss:            {action: rollback}
  corrupt_checkpoint:  {action: rollback}
  short_segment:       {action: abort}
"""
SCRIPTS = {
    "lightning": ("lightning_gpt2.py", '[--devices, "2", --nodes, "2"]'),
    "hf": ("hf_gpt2.py", "[]"),
}
FAULTS = [
    # Rank 2 stalls before its step 8: the others wait in DDP's all-reduce of step 8.
    {"kind": "hang", "segment": 0, "step": 8, "rank": 2, "attempt": 1},
    # Segment 1's task adopts the workload (which trains on past step 20) within seconds:
    # pacing its steps (every rank alike) puts the freeze well after that adoption.
    {"kind": "pace", "segment": 1, "step": 20, "seconds": 0.3},
    {"kind": "stop_node", "segment": 1, "step": 36, "node": "node-a", "attempt": 1},
]


@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_callback_script_recovers_from_a_stalled_rank_and_a_frozen_node(
    framework: str, relay_home: Path, tmp_path: Path
) -> None:
    script, args = SCRIPTS[framework]
    name = f"cb_{framework}"
    (tmp_path / "jobs").mkdir()
    (tmp_path / "policies").mkdir()
    (tmp_path / "jobs" / f"{name}.yaml").write_text(
        JOB.format(name=name, script=EXAMPLES / script, args=args))
    (tmp_path / "policies" / "callbacks.yaml").write_text(POLICY)
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"  # never a download
    env = use_jobs(relay_home, tmp_path / "jobs")
    free_the_pool()  # the frozen node is node-a: the workload of segment 1 must run there
    code, parent = run_job(env, relay_home, name, {"chaos": FAULTS}, name, timeout_seconds=1500)
    log_file = relay_home / "logs" / f"{name}.log"
    assert code == 0, f"airflow dags test failed; see {log_file}:\n{log_file.read_text()[-4000:]}"
    lineage = Lineage.from_settings()
    records = fault_records(lineage, parent, tmp_path / "records")
    faults = sorted((r["fault"]["kind"], r["fault"]["culprit_node"]) for r in records.values())
    hangs = [r["fault"]["culprit_rank"] for r in records.values() if r["fault"]["kind"] == "hang"]
    expected = [("hang", "node-b"), ("node_unresponsive", "node-a")]
    assert (faults, hangs) == (expected, [2]), "\n".join(
        f"segment {a.segment} try {a.try_number} on {a.nodes}: {a.outcome}"
        for a in run_view(lineage, parent).attempts)
    for record in records.values():  # a healthy rank handed over the trainer's state
        assert record["rescued"] is not None, record
        assert record["lost_steps"] == 0, record
    state = final_state(lineage, parent, tmp_path / "final", [60, 5])
    weights = state["lightning"]["state_dict"] if framework == "lightning" else state["model"]
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())
    steps = (state["lightning"]["global_step"] if framework == "lightning"
             else json.loads(state["trainer_state"])["global_step"])
    assert steps == 60  # the trainer's own step counter went along with Relay's
    assert workload_processes(relay_home) == {}


@pytest.mark.parametrize(("script", "args"), [
    ("lightning_gpt2_plain.py", ["--devices", "2"]), ("hf_gpt2_plain.py", []),
])
def test_plain_script_runs_under_torchrun(script: str, args: list[str], tmp_path: Path) -> None:
    """The 'before' scripts of the worker API page's diffs are real torchrun scripts."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLES / script), "--steps", "6", *args],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
