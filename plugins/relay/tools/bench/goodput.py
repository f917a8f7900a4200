"""`relay bench goodput`: one job, one fault schedule, Relay versus a torchrun baseline.

Per repeat, four runs of the same job (2 nodes x 2 ranks, real DDP over gloo,
the same training loop), each with the same pool of 5 nodes, 2 used at a time:

1. Relay, fault-free, through ``airflow dags test``;
2. Relay with the fault schedule, through ``airflow dags test``;
3. the torchrun baseline, fault-free;
4. the torchrun baseline with the same fault schedule and a collective timeout
   a careful team would set (``--collective-timeout``); see
   :mod:`relay.tools.bench.torchrun_baseline` for what it is and why it is not
   ``--max-restarts``.

Each side's fault-free and faulty runs swap order every other repeat (odd repeats
run the fault-free one first), so a drift of the host's pace over a repeat does
not always fall on the faulty run.

With gloo's default timeout (30 min) the baseline's figures are *derived*
unless ``--measure-default-timeout`` runs it for real: measured wall time +
(1800 s - the short timeout) for every fault that only the collective timeout
ended (a hang, a frozen node), everything else equal.

The schedule strikes once each, the first time the job reaches a step: a stalled
rank (rank position 1), a frozen node (every process of the node that hosts
rank position 2: its agent - Relay's node agent or torchrun - and its ranks),
and a node that turns 3x slow and stays slow (the node hosting rank position 3).
A slow node the baseline cannot see costs it its slowdown and has no fault row.
ETTR = productive time / wall time; productive time = total steps x the
seconds per step of the repeat's two fault-free runs' training loops, pooled
(rank 0's ``result.json``: loop time / steps).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.lineage.report import first_step_at
from relay.lineage.resume_time import KEY, fault_onset, preflight_started_at, time_to_resume
from relay.lineage.store import Lineage
from relay.tools.airflow_env import airflow_env, ensure_airflow_db
from relay.tools.bench.boundary_time import boundaries, format_row
from relay.tools.bench.goodput_report import print_repeat, print_summary
from relay.tools.bench.startup_time import format_parts as format_startup
from relay.tools.bench.startup_time import startup_parts
from relay.tools.bench.torchrun_baseline import BaselineRun, run_baseline

MODEL = {"context": 64, "d_model": 64, "n_layers": 2, "n_heads": 4, "dropout": 0.1}
DATA = {"corpus": "builtin:python_docs", "batch_size": 16}
NODE_POOL = ["node-a", "node-b", "node-c", "node-d", "node-e"]
GLOO_DEFAULT_TIMEOUT_SECONDS = 1800.0
SMOKE = {"steps": 160, "segment": 80, "every": 20, "collective_timeout": 15.0, "repeats": 1}


@dataclass
class Run:
    """What one run cost."""

    name: str
    ok: bool
    wall: float
    attempts: int
    faults: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    started: float = 0.0  # wall-clock time the run started


def ends(run: Run, attempts: list[Path]) -> str:
    """Say how much of a run's wall time went before its first step and after its last."""
    ended = [json.loads((a / "result.json").read_text())["loop_ended_at"]
             for a in attempts if (a / "result.json").exists()]
    first = first_step_at(attempts[0]) if attempts else None
    if first is None or not ended:
        return "start-up and wind-down unknown (no first step or result.json)"
    split = ""
    relay_from = preflight_started_at(attempts[0].parent.parent)  # Relay's runs only
    if relay_from is not None:
        split = (f": Airflow {relay_from - run.started:.1f}s until Relay's preflight started, "
                 f"Relay {first - relay_from:.1f}s from there")
    return (f"start-up {first - run.started:.1f}s (run start -> first step done{split}), "
            f"wind-down {run.started + run.wall - max(ended):.1f}s (last step -> run end)")


def fault_schedule(steps: int) -> list[dict[str, Any]]:
    """Return the schedule both sides get: same kinds, steps and rank positions."""
    a, b, c = int(steps * 0.2) + 7, int(steps * 0.45) + 7, int(steps * 0.7) + 7
    return [
        {"kind": "hang", "step": a, "rank": 1, "attempt": None, "once": True},
        {"kind": "stop_node", "step": b, "rank": 2, "attempt": None, "once": True},
        {"kind": "straggler", "step": c, "rank": 3, "attempt": None, "once": True,
         "factor": 3.0},
    ]


def _job_yaml(steps: int, segment: int, every: int, boundary: str = "adopt") -> str:
    return (
        f"job: goodput\nseed: 11\ntotal_steps: {steps}\nsteps_per_segment: {segment}\n"
        f"segment_boundary: {boundary}\n"
        f"checkpoint_every: {every}\nnodes: 2\nranks_per_node: 2\n"
        "chaos: allowed\n"  # the benchmark's fault schedule comes in the DAG run's conf
        f"model: {json.dumps(MODEL)}\ndata: {json.dumps(DATA)}\n"
    )


def seconds_per_step(attempts: list[Path]) -> float:
    """Return rank 0's loop seconds per step over the attempts' result.json files."""
    steps = seconds = 0.0
    for attempt in attempts:
        result = attempt / "result.json"
        if result.exists():
            data = json.loads(result.read_text())
            steps += data["steps"]
            seconds += data["loop_seconds"]
    return seconds / steps if steps else float("nan")


def relay_faults(attempts: list[Path]) -> list[dict[str, Any]]:
    """Return one row per recovery Relay made (an attempt with a decision.json)."""
    rows = []
    for attempt in attempts:
        decision = attempt / "decision.json"
        if not decision.exists():
            continue
        record = json.loads(decision.read_text())
        onset = fault_onset(attempt)
        breakdown = record.get(KEY, {})
        nxt = attempt.with_name(f"try-{int(attempt.name.split('-')[1]) + 1}")
        found = time_to_resume(onset, record["fault"]["detected_at"],
                               first_step_at(nxt) if nxt.exists() else None)
        resume = breakdown.get("total") if breakdown.get("complete") else (
            found.total if onset is not None else None)  # no onset: a false alarm
        detected = found.detect
        rows.append({"kind": record["fault"]["kind"], "lost_steps": record.get("lost_steps"),
                     "detected_after": detected, "fault_to_resume": resume,
                     "ended_by": "Relay's watcher" if onset is not None
                     else "Relay's watcher; nothing was injected: a false alarm",
                     "parts": breakdown.get("parts")})
    return rows


def prepare_home(home: Path, job_yaml: str) -> None:
    """Make ``home`` the benchmark's Relay home with the goodput job; create Airflow's and
    MLflow's databases, before any run's clock starts."""
    jobs = home / "jobs"
    jobs.mkdir()
    (jobs / "goodput.yaml").write_text(job_yaml)
    os.environ.update({"RELAY_HOME": str(home), "RELAY_JOBS_DIR": str(jobs),
                       "RELAY_NODES": ",".join(NODE_POOL)})
    ensure_airflow_db(airflow_env(home), home / "logs" / "airflow-db.log")
    Lineage.from_settings().ensure_store()  # MLflow's tables too


def run_relay(home: Path, schedule: list[dict[str, Any]], name: str,
              prestart: bool = True) -> tuple[Run, list[Path]]:
    """Run the job through Airflow under Relay (``prestart``: see
    :func:`relay.tools.demo.run_dag_test`); return its outcome and attempt folders (none if
    the DAG run never started)."""
    from relay.tools.demo import run_dag_test

    (home / "nodes.json").unlink(missing_ok=True)  # no quarantine carries over between runs
    env = airflow_env(home)
    log_file = home / "logs" / f"{name.replace(' ', '-')}.log"
    started = time.time()
    code = run_dag_test("relay_goodput", {"chaos": schedule}, env, log_file,
                        prestart=prestart).wait()
    wall = time.time() - started
    dag_dir = home / "runs" / "relay_goodput"
    runs = sorted(dag_dir.iterdir(), key=lambda p: p.stat().st_mtime) if dag_dir.is_dir() else []
    attempts = sorted(runs[-1].glob("segment-*/try-*")) if runs else []
    return Run(name, code == 0, wall, len(attempts), relay_faults(attempts),
               started=started), attempts


def startup_text(run: Run, run_dir: Path) -> str:
    """Return a Relay run's start-up, part by part, from its ``airflow dags test`` log."""
    log_file = run_dir.parents[2] / "logs" / f"{run.name.replace(' ', '-')}.log"
    return format_startup(startup_parts(run.started, log_file, run_dir))


def baseline_run(name: str, run: BaselineRun) -> Run:
    """Turn a supervised torchrun job into a row."""
    faults = [{"kind": r.kind, "lost_steps": r.lost_steps, "detected_after": r.detected_after,
               "fault_to_resume": r.fault_to_resume, "ended_by": r.ended_by}
              for r in run.recoveries]
    return Run(name, run.ok, run.wall, run.attempts, faults,
               note=f"nodes used: {', '.join(run.nodes_used)}", started=run.started)


def derive_default_timeout(measured: Run, short: float) -> Run:
    """Return the baseline with gloo's default timeout, derived from a short-timeout run."""
    extra = GLOO_DEFAULT_TIMEOUT_SECONDS - short
    faults, hangs = [], 0
    for f in measured.faults:
        if f["ended_by"] == "collective timeout":
            hangs += 1
            f = {**f, **{k: (f[k] + extra if f[k] is not None else None)
                         for k in ("detected_after", "fault_to_resume")}}
        faults.append(f)
    note = (f"DERIVED, not measured: {measured.wall:.1f}s measured + {hangs} x "
            f"({GLOO_DEFAULT_TIMEOUT_SECONDS:g} - {short:g})s")
    return Run(f"torchrun, timeout {GLOO_DEFAULT_TIMEOUT_SECONDS:g}s", measured.ok,
               measured.wall + hangs * extra, measured.attempts, faults, note)


def _job(steps: int, every: int) -> dict[str, Any]:
    return {"seed": 11, "model": MODEL, "data": DATA, "optimizer": {"lr": 0.003},
            "steps": steps, "every": every, "nodes": 2, "ranks_per_node": 2}


def one_repeat(home: Path, repeat: int, args: dict[str, Any]) -> tuple[list[Run], float]:
    """Run every configuration once; return the rows and the productive time.

    Each side's fault-free and faulty runs swap order every other repeat, so a drift of
    the host's pace over a repeat does not fall on the same run each time."""
    schedule, timeout = fault_schedule(args["steps"]), args["collective_timeout"]
    job = _job(args["steps"], args["every"])
    base = home / "baseline" / f"repeat-{repeat}"
    swap = repeat % 2 == 0
    relay: dict[bool, tuple[Run, list[Path]]] = {}
    for faulty in ((True, False) if swap else (False, True)):
        relay[faulty] = _relay_run(home, schedule if faulty else [])
    (free, free_attempts), (faulty_run, faulty_attempts) = relay[False], relay[True]
    baseline: dict[bool, Run] = {}
    for faulty in ((True, False) if swap else (False, True)):
        baseline[faulty] = _baseline_run(base, job, schedule if faulty else [], timeout)
    plain, short = baseline[False], baseline[True]
    runs = [free, faulty_run, plain, short]
    if args["measure_default_timeout"]:
        default = baseline_run(f"torchrun, timeout {GLOO_DEFAULT_TIMEOUT_SECONDS:g}s",
                               run_baseline(base / "faults-default", job, schedule, NODE_POOL,
                                            GLOO_DEFAULT_TIMEOUT_SECONDS))
        default.note = f"measured; {default.note}"
        runs.append(default)
    else:
        runs.append(derive_default_timeout(short, timeout))
    # Both fault-free runs train the same loop: pool them, so one run's bad moment on a
    # shared machine does not set every ETTR of the repeat.
    plain_attempts = baseline_attempts(base)
    pooled = seconds_per_step(free_attempts + plain_attempts)
    print_pace(free_attempts, plain_attempts, faulty_attempts, pooled)
    return runs, args["steps"] * pooled


def _relay_run(home: Path, schedule: list[dict[str, Any]]) -> tuple[Run, list[Path]]:
    """Run Relay with ``schedule`` (none: fault-free); print what it cost."""
    if not schedule:
        free, attempts = run_relay(home, [], "relay fault-free")
        print(f"    relay fault-free: {free.wall:.1f}s; {ends(free, attempts)}", flush=True)
        if attempts:  # where the start-up went (relay.tools.bench.startup_time)
            print(f"      start-up {startup_text(free, attempts[0].parent.parent)}", flush=True)
        if attempts:  # what each segment boundary cost (relay.tools.bench.boundary_time)
            for row in boundaries(attempts[0].parent.parent):
                print(f"      boundary {format_row(row)}", flush=True)
        return free, attempts
    faulty, attempts = run_relay(home, schedule, "relay with faults")
    print(f"    relay with faults: {faulty.wall:.1f}s", flush=True)
    return faulty, attempts


def baseline_attempts(base: Path) -> list[Path]:
    """Return the attempt folders of the fault-free torchrun baseline run under ``base``."""
    return sorted((base / "fault-free").glob("segment-*/try-*"))


def _baseline_run(base: Path, job: dict[str, Any], schedule: list[dict[str, Any]],
                  timeout: float, tracking_uri: str | None = None) -> Run:
    """Run the torchrun baseline with ``schedule`` (none: fault-free); print its wall."""
    if not schedule:
        plain = baseline_run("torchrun fault-free", run_baseline(
            base / "fault-free", job, [], NODE_POOL, timeout, tracking_uri))
        print(f"    torchrun fault-free: {plain.wall:.1f}s; {ends(plain, baseline_attempts(base))}",
              flush=True)
        return plain
    short = baseline_run(f"torchrun, timeout {timeout:g}s", run_baseline(
        base / "faults-short", job, schedule, NODE_POOL, timeout, tracking_uri))
    print(f"    torchrun with faults, timeout {timeout:g}s: {short.wall:.1f}s", flush=True)
    return short


def print_pace(free: list[Path], plain: list[Path], faulty: list[Path], pooled: float) -> None:
    """Print each Relay run's training pace next to the pooled one that sets productive time:
    a run that stepped slower (a slower moment of a shared host, or a straggler before it
    was caught) shows it here, and its ETTR counts that as time lost."""
    ms = {name: 1000 * seconds_per_step(attempts) for name, attempts in
          (("relay", free), ("torchrun", plain), ("faulty", faulty))}
    print(f"    rank 0's loop, ms per step: fault-free Relay {ms['relay']:.0f}, torchrun "
          f"{ms['torchrun']:.0f}, pooled {1000 * pooled:.0f} (sets productive time); Relay "
          f"with faults {ms['faulty']:.0f} over its attempts that finished", flush=True)


def refuse_keep(bench: str, keep: Path | None) -> bool:
    """Say on stderr, and return True, if ``keep`` is a file or a folder with files in it."""
    if keep is None or not keep.exists() or (keep.is_dir() and not any(keep.iterdir())):
        return False
    print(f"relay bench {bench} --keep {keep}: expected a new or empty folder, found "
          f"{'one with files in it' if keep.is_dir() else 'a file'}; name another folder",
          file=sys.stderr)
    return True


def main(steps: int = 1200, segment: int = 300, every: int = 25, collective_timeout: float = 120.0,
         repeats: int = 3, smoke: bool = False, measure_default_timeout: bool = False,
         segment_boundary: str = "adopt", keep: Path | None = None) -> int:
    """Run the repeats and print ETTR, lost steps and time to resume side by side;
    ``keep``: run in this new folder and leave it (every attempt's logs) for a reader."""
    args: dict[str, Any] = {"steps": steps, "segment": segment, "every": every,
                            "collective_timeout": collective_timeout, "repeats": repeats,
                            "measure_default_timeout": measure_default_timeout}
    if refuse_keep("goodput", keep):
        return 2
    if smoke:
        args.update(SMOKE)
    schedule = fault_schedule(args["steps"])
    print(f"Goodput benchmark{' (SMOKE: too short for figures)' if smoke else ''}: "
          f"{args['steps']} steps, segments of {args['segment']}, checkpoint every "
          f"{args['every']}, 2 nodes x 2 ranks from a pool of {len(NODE_POOL)} nodes for both, "
          f"{args['repeats']} repeat(s); Relay's segment boundaries: {segment_boundary}\n"
          f"  Same schedule for both (once each, the first time the job reaches the step): "
          f"stalled rank 1 at step {schedule[0]['step']}; frozen node (SIGSTOP of its agent and "
          f"ranks) hosting rank 2 at step {schedule[1]['step']}; the node hosting rank 3 turns "
          f"3x slow at step {schedule[2]['step']} and stays slow\n"
          "  Relay: airflow dags test started by Relay's runner (relay.tools.demo.run_dag_test, as "
          "relay demo does: it prestarts the run's resident agent beside Airflow's start-up; "
          "the clock includes it), policies/default.yaml. Baseline: one torchrun per node "
          "(--max-restarts 0) in a supervisor loop that restarts the whole job from the last "
          "checkpoint and swaps out a node that stopped answering; torchrun's own "
          "--max-restarts is not used because in-job restarts failed here (torch 2.13, gloo: "
          "'Gloo connectFullMesh failed ... Connection refused', stale peer addresses; "
          "pytorch#167288)\n"
          "  Compared: every run's absolute ETTR (productive time / wall time; productive time = "
          "total steps x the pooled seconds per step of the two fault-free training loops), lost "
          "steps and fault -> first productive step, Relay's runs next to the baseline's; each "
          "side's fault-free and faulty runs swap order every other repeat. Both sides' "
          "databases (Airflow's, each side's MLflow store) are created before a run's clock "
          "starts; inside it, each run creates its own MLflow run (Relay's preflight, the "
          "baseline's supervisor) and ends when its job does",
          flush=True)
    all_runs: list[list[Run]] = []
    productive: list[float] = []
    with (contextlib.nullcontext(str(keep)) if keep is not None
          else tempfile.TemporaryDirectory(prefix="relay-bench-goodput-")) as tmp:
        home = Path(tmp)
        home.mkdir(parents=True, exist_ok=True)
        prepare_home(home, _job_yaml(args["steps"], args["segment"], args["every"],
                                     segment_boundary))
        for repeat in range(1, args["repeats"] + 1):
            print(f"  repeat {repeat}/{args['repeats']}:", flush=True)
            runs, prod = one_repeat(home, repeat, args)
            print_repeat(runs, prod)
            all_runs.append(runs)
            productive.append(prod)
    print_summary(all_runs, productive, args["collective_timeout"])
    return 0 if all(r.ok for runs in all_runs for r in runs) else 1
