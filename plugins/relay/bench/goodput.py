"""`relay bench goodput`: one job, one fault schedule, Relay versus a torchrun baseline.

Three runs of the same job (2 nodes x 2 ranks, real DDP over gloo):

1. Relay, fault-free, through `airflow dags test` (the reference);
2. Relay with the fault schedule, through `airflow dags test`;
3. the baseline: plain `torchrun` (`--max-restarts 0`, since in-job restarts do
   not work with gloo here), restarted as a whole from the last checkpoint by a
   supervisor loop after every failure, always on the same two nodes; a hang or
   a frozen node ends only at the collective timeout set for it.

The schedule strikes, once each, the first time the job reaches a step: a
stalled rank, a frozen node (every rank on it stops), and a node that turns
slow and stays slow (a straggler). ETTR = productive step time / wall time,
where productive step time = total steps x the fault-free run's seconds per step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.airflow_env import airflow_env, ensure_airflow_db
from relay.launchers.local import free_port
from relay.report import chaos_strikes, first_step_at
from training.heartbeat import read_heartbeats
from training.launch import LaunchConfig, ResumeFrom

MODEL = {"context": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "dropout": 0.1}
DATA = {"corpus": "builtin:python_docs", "batch_size": 16}


@dataclass
class Outcome:
    """What one run cost."""

    name: str
    wall: float
    ok: bool
    faults: list[dict[str, Any]] = field(default_factory=list)  # kind, lost, resume seconds
    attempts: int = 0


def _job_yaml(steps: int, segment: int, every: int) -> str:
    return (
        f"job: goodput\nseed: 11\ntotal_steps: {steps}\nsteps_per_segment: {segment}\n"
        f"checkpoint_every: {every}\nnodes: 2\nranks_per_node: 2\n"
        f"model: {json.dumps(MODEL)}\ndata: {json.dumps(DATA)}\n"
    )


def _seconds_per_step(attempts: list[Path]) -> float:
    steps = seconds = 0.0
    for attempt in attempts:
        result = attempt / "result.json"
        if result.exists():
            data = json.loads(result.read_text())
            steps += data["steps"]
            seconds += data["loop_seconds"]
    return seconds / steps if steps else float("nan")


def run_relay(home: Path, schedule: list[dict[str, Any]], name: str) -> tuple[Outcome, list[Path]]:
    """Run the job through Airflow under Relay; return its outcome and attempt folders."""
    from relay.demo import run_dag_test

    env = airflow_env(home)
    log_file = home / "logs" / f"{name}.log"
    started = time.time()
    code = run_dag_test("relay_goodput", {"chaos": schedule}, env, log_file).wait()
    wall = time.time() - started
    runs = sorted((home / "runs" / "relay_goodput").iterdir(), key=lambda p: p.stat().st_mtime)
    attempts = sorted(runs[-1].glob("segment-*/try-*"))
    outcome = Outcome(name, wall, code == 0, attempts=len(attempts))
    for attempt in attempts:
        decision = attempt / "decision.json"
        strikes = chaos_strikes(attempt)
        if not strikes:
            continue
        nxt = attempt.with_name(f"try-{int(attempt.name.split('-')[1]) + 1}")
        first = first_step_at(nxt) if nxt.exists() else None
        record = json.loads(decision.read_text()) if decision.exists() else {}
        outcome.faults.append({
            "kind": record.get("fault", {}).get("kind", strikes[0]["kind"]),
            "lost_steps": record.get("lost_steps"),
            "fault_to_resume": (first - strikes[0]["at"]) if first else None,
            "rescued": bool(record.get("rescued")),
        })
    return outcome, attempts


def run_baseline(
    home: Path, schedule: list[dict[str, Any]], steps: int, every: int, timeout: float
) -> Outcome:
    """Run the job under torchrun, restarting it whole from the last checkpoint after failures."""
    from relay.lineage import Lineage

    lineage = Lineage(f"sqlite:///{home / 'baseline-mlflow.db'}", home / "baseline-artifacts")
    parent = lineage.parent_run("goodput-baseline", "baseline", f"baseline-{int(time.time())}")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    job = home / "baseline" / "run"
    started = time.time()
    outcome = Outcome("torchrun baseline", 0.0, False)
    previous: Path | None = None
    for attempt in range(1, 30):
        attempt_dir = job / "segment-000" / f"try-{attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        latest = lineage.latest_valid_checkpoint(parent, attempt_dir / "resume")
        resume_step = latest.manifest.step if latest else 0
        if previous is not None:
            beats = read_heartbeats(previous / "heartbeats")
            reached = max((b.step for b in beats.values()), default=resume_step)
            strikes = chaos_strikes(previous)
            outcome.faults.append({
                "kind": strikes[0]["kind"] if strikes else "unknown",
                "lost_steps": max(reached - resume_step, 0),
                "strike_at": strikes[0]["at"] if strikes else None,
                "attempt_dir": attempt_dir,
            })
        if resume_step >= steps:
            outcome.ok = True
            break
        run_id = lineage.attempt_run(parent, 0, attempt, {"resume_step": resume_step})
        cfg = LaunchConfig(
            job="goodput-baseline", seed=11, model=MODEL, data=DATA, optimizer={"lr": 0.003},
            start_step=resume_step, end_step=steps, checkpoint_every=every,
            nodes=["node-a", "node-b"], ranks_per_node=2, master_addr="127.0.0.1",
            master_port=free_port(), tracking_uri=lineage.tracking_uri, run_id=run_id,
            attempt_dir=str(attempt_dir), attempt=attempt, segment=0,
            collective_timeout_seconds=timeout, chaos=schedule,
            resume=ResumeFrom(str(latest.path), latest.manifest.sha256, latest.manifest.run_id,
                              latest.manifest.step) if latest else None,
        )
        launch = attempt_dir / "launch.json"
        cfg.write(launch)
        with (attempt_dir / "torchrun.log").open("wb") as out:
            subprocess.run(
                [torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", "4",
                 "--max-restarts", "0", "-m", "training.torchrun_worker", "--launch", str(launch)],
                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                check=False,
            )
        outcome.attempts = attempt
        previous = attempt_dir
    outcome.wall = time.time() - started
    for fault in outcome.faults:
        first = first_step_at(fault.pop("attempt_dir"))
        strike = fault.pop("strike_at")
        fault["fault_to_resume"] = (first - strike) if first and strike else None
    return outcome


def main(
    steps: int = 1200, segment: int = 300, every: int = 25, collective_timeout: float = 120.0
) -> int:
    """Run the three runs and print ETTR, lost steps and time to resume side by side."""
    a, b, c = int(steps * 0.2) + 7, int(steps * 0.45) + 7, int(steps * 0.7) + 7
    # Relay moves off each faulty node, so the node that turns slow is the one rank 3
    # is on by then (node-d); the baseline never moves, so there it is node-b.
    relay_schedule = [
        {"kind": "hang", "step": a, "rank": 1, "attempt": None, "once": True},
        {"kind": "stop_node", "step": b, "rank": 2, "attempt": None, "once": True},
        {"kind": "straggler", "step": c, "node": "node-d", "attempt": None, "factor": 3.0},
    ]
    baseline_schedule = [
        {"kind": "hang", "step": a, "rank": 1, "attempt": None, "once": True},
        {"kind": "stop_rank", "step": b, "rank": 2, "attempt": None, "once": True},
        {"kind": "stop_rank", "step": b, "rank": 3, "attempt": None, "once": True},
        {"kind": "straggler", "step": c, "node": "node-b", "attempt": None, "factor": 3.0},
    ]
    with tempfile.TemporaryDirectory(prefix="relay-bench-goodput-") as tmp:
        home = Path(tmp)
        jobs = home / "jobs"
        jobs.mkdir()
        (jobs / "goodput.yaml").write_text(_job_yaml(steps, segment, every))
        os.environ.update({"RELAY_HOME": str(home), "RELAY_JOBS_DIR": str(jobs)})
        ensure_airflow_db(airflow_env(home), home / "logs" / "airflow-db.log")
        print(f"Goodput benchmark: {steps} steps, segments of {segment}, checkpoint every "
              f"{every}; faults at steps {a} (stalled rank), {b} (frozen node), {c} (slow node); "
              f"baseline collective timeout {collective_timeout:g}s", flush=True)
        reference, ref_attempts = run_relay(home, [], "relay fault-free")
        print(f"  relay fault-free:  {reference.wall:6.1f}s", flush=True)
        faulty, _ = run_relay(home, relay_schedule, "relay with faults")
        print(f"  relay with faults: {faulty.wall:6.1f}s", flush=True)
        baseline = run_baseline(home, baseline_schedule, steps, every, collective_timeout)
        print(f"  torchrun baseline: {baseline.wall:6.1f}s", flush=True)
        per_step = _seconds_per_step(ref_attempts)  # before the temporary folder goes
    productive = steps * per_step

    def ettr(o: Outcome) -> float:
        return productive / o.wall if o.ok else 0.0

    print(f"\n  productive step time: {steps} steps x {per_step * 1000:.1f} ms = {productive:.1f}s")
    print(f"  {'run':20} {'ok':>3} {'wall':>8} {'ETTR':>6} {'attempts':>8}  faults (lost steps, "
          "fault -> first productive step)")
    for o in (reference, faulty, baseline):
        detail = "; ".join(
            f"{f['kind']} ({f['lost_steps']}, "
            + (f"{f['fault_to_resume']:.1f}s)" if f["fault_to_resume"] is not None else "-)")
            for f in o.faults
        ) or "-"
        print(f"  {o.name:20} {'yes' if o.ok else 'NO':>3} {o.wall:7.1f}s {ettr(o):6.2f} "
              f"{o.attempts:>8}  {detail}")
    resumes = [f["fault_to_resume"] for f in faulty.faults if f["fault_to_resume"] is not None]
    if reference.ok and faulty.ok:
        ratio = ettr(faulty) / ettr(reference)
        print(f"\n  Relay ETTR / fault-free ETTR: {ratio:.2f} (goal >= 0.8)")
    if baseline.ok and faulty.ok:
        print(f"  Relay ETTR / baseline ETTR:   {ettr(faulty) / ettr(baseline):.2f} (goal >= 2)")
    if resumes:
        print(f"  Relay fault -> first productive step: median {statistics.median(resumes):.1f}s, "
              f"max {max(resumes):.1f}s (goal <= 15s)")
    return 0 if reference.ok and faulty.ok and baseline.ok else 1
