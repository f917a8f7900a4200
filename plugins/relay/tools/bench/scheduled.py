"""`relay bench scheduled`: fault -> first productive step with Airflow's real services.

`relay bench goodput` runs Relay under ``airflow dags test``: one process runs
the DAG, and a deferred task's trigger runs in that process. Here the same job
(``relay.tools.bench.goodput._job_yaml``, the same node pool) runs in the deployment
of `make up` (:mod:`relay.tools.services`): the API server, the scheduler, the DAG
processor and the triggerer as separate processes, the LocalExecutor, and an
MLflow server, all on 127.0.0.1 in a temporary home. Each repeat triggers
``relay_goodput`` through the REST API with the goodput fault schedule in its
conf, waits until the DAG run ends, and reads the run's attempt folders with
``relay.tools.bench.goodput.relay_faults``: per fault, when it was detected, the steps
it lost and its time to resume, part by part (``decision.json``
``time_to_resume``). No fault-free run and no baseline: this measures the time
to resume only, against the goal of issue 12 (median <= 9.5 s).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import requests

from relay.core import settings
from relay.core.airflow_api import AirflowApi
from relay.core.exceptions import ServiceError
from relay.core.paths import safe_name
from relay.tools import services
from relay.tools.bench.goodput import (
    NODE_POOL,
    SMOKE,
    Run,
    _baseline_run,
    _job,
    _job_yaml,
    baseline_attempts,
    ends,
    fault_schedule,
    print_pace,
    relay_faults,
    seconds_per_step,
)
from relay.tools.bench.goodput_report import (
    GOAL_ETTR,
    ettr,
    format_parts,
    print_breakdown,
    print_ettr,
    sec_text,
    spread,
    toward_goal,
    verdict,
)

DAG_ID = "relay_goodput"
GOAL_SECONDS = 9.5  # issue 12: fault -> first productive step with the real scheduler
BASELINE_COLLECTIVE_TIMEOUT = 120.0  # goodput's default; a fault-free run never reaches it
ENV_VARS = ("RELAY_HOME", "RELAY_JOBS_DIR", "RELAY_NODES", "RELAY_MLFLOW_TRACKING_URI")


class RunFailed(RuntimeError):
    """A DAG run of the benchmark did not succeed (or did not end in time)."""


def summarise(runs: list[Run]) -> dict[str, dict[str, list[float]]]:
    """Return, per fault kind, every repeat's detection, lost steps and time to resume."""
    found: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for fault in run.faults:
            by_kind = found.setdefault(fault["kind"], {
                "detected_after": [], "lost_steps": [], "fault_to_resume": []})
            for key, values in by_kind.items():
                if fault.get(key) is not None:
                    values.append(float(fault[key]))
    return found


def goal_verdict(values: list[float], goal: float = GOAL_SECONDS) -> str:
    """Say whether the median time to resume meets the goal, and in how many repeats."""
    if not values:
        return "no figure"
    return f"goal <= {goal:g}s: {verdict(values, lambda v: v <= goal)}"


def figure(values: list[float]) -> str:
    """Return one value as is, several as ``median [min-max]``."""
    return f"{values[0]:.1f}s" if len(values) == 1 else spread(values)


def print_run(run: Run) -> None:
    """Print one repeat's DAG run and its faults, each with its time-to-resume parts."""
    print(f"    {run.name}: {'succeeded' if run.ok else 'FAILED'} in {run.wall:.1f}s, "
          f"{run.attempts} attempt(s); {run.note}", flush=True)
    for f in run.faults:
        detected, resumed = sec_text(f["detected_after"], 2), sec_text(f["fault_to_resume"], 2)
        print(f"      {f['kind']:18} detected after {detected}; lost steps {f['lost_steps']}; "
              f"fault -> first productive step {resumed} ({f['ended_by']})", flush=True)
        parts = f.get("parts") or {}
        if parts:
            added = sum(s for s in parts.values() if s is not None)
            print(f"        time to resume: {format_parts(parts, 2)} (sum {added:.2f}s)",
                  flush=True)


def print_summary(all_runs: list[list[Run]], productives: list[float]) -> None:
    """Print median [min-max] per fault kind over the repeats, the parts' medians and, with
    fault-free runs, every run's ETTR."""
    runs = [repeat[0] for repeat in all_runs]  # the faulty DAG run of each repeat
    over = ", median [min-max]" if len(runs) > 1 else ""
    print(f"\n  Over {len(runs)} repeat(s){over}; goal of issue 12: fault -> first productive "
          f"step <= {GOAL_SECONDS:g}s with the real scheduler and triggerer")
    print(f"  {'kind':18} {'fault -> first step':24} {'detected after':24} lost steps")
    for kind, found in summarise(runs).items():
        lost = "/".join(str(int(v)) for v in found["lost_steps"]) or "-"
        print(f"  {kind:18} {figure(found['fault_to_resume']):24} "
              f"{figure(found['detected_after']):24} {lost:10} "
              f"{goal_verdict(found['fault_to_resume'])}")
    print_breakdown([runs])
    if productives:
        print_ettr(all_runs, productives)
        free = [ettr(r, p) for repeat, p in zip(all_runs, productives, strict=True)
                for r in repeat if r.name == "relay fault-free"]
        print(f"  goal of issue 12: absolute ETTR >= {GOAL_ETTR:g} fault-free: "
              f"{' / '.join(toward_goal(v, 3, True) for v in free)}: "
              f"{verdict(free, lambda v: v >= GOAL_ETTR)}")


def wait_for_run(api: AirflowApi, run_id: str, timeout: float) -> str:
    """Wait until a DAG run ends; return its state ("timed out" if it did not end in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = str(api.dag_run(DAG_ID, run_id)["state"])
        except (requests.RequestException, ServiceError):
            state = "unknown"  # a busy API server: ask again
        if state in ("success", "failed"):
            return state
        time.sleep(2)
    return "timed out"


def dag_run_ended_at(api: AirflowApi, run_id: str) -> float | None:
    """Return when Airflow recorded the DAG run's end (its ``end_date``), as a Unix time."""
    try:
        end = api.dag_run(DAG_ID, run_id).get("end_date")
    except (requests.RequestException, ServiceError):
        return None
    return datetime.fromisoformat(end).timestamp() if end else None


def relay_run(api: AirflowApi, home: Path, schedule: list[dict[str, Any]], timeout: float,
              name: str) -> tuple[Run, list[Path]]:
    """Trigger one DAG run with ``schedule`` (none: fault-free) through the REST API; return
    it and its attempt folders. Its wall time runs from the trigger request to the end
    Airflow recorded for the run (not to when this loop, polling, saw it)."""
    (home / "nodes.json").unlink(missing_ok=True)  # no quarantine carries over between runs
    started = time.time()
    run_id = api.trigger(DAG_ID, {"chaos": schedule})
    state = wait_for_run(api, run_id, timeout)
    ended = dag_run_ended_at(api, run_id) if state == "success" else None
    wall = (ended or time.time()) - started
    run_dir = settings.runs_dir() / DAG_ID / safe_name(run_id)
    if state != "success":
        try:
            tries = {t["task_id"]: (t["state"], t["try_number"])
                     for t in api.task_instances(DAG_ID, run_id)}
        except (requests.RequestException, ServiceError) as exc:
            tries = {"(task instances unreadable)": (str(exc), 0)}
        logs = home / "airflow" / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}"
        raise RunFailed(f"DAG run {run_id} of {DAG_ID} ended {state} after {wall:.0f}s "
                        f"(timeout {timeout:.0f}s); tasks (state, try): {tries}. Task logs: "
                        f"{logs}; Relay's attempt folders: {run_dir}; services' logs: "
                        f"{services.services_dir(home) / 'logs'}")
    attempts = sorted(run_dir.glob("segment-*/try-*"))
    return Run(name, True, wall, len(attempts), relay_faults(attempts),
               note=f"run {run_id}", started=started), attempts


def one_repeat(api: AirflowApi, home: Path, args: dict[str, Any], repeat: int,
               tracking_uri: str) -> tuple[list[Run], float | None]:
    """Run one repeat: the faulty DAG run and, for ETTR, a fault-free one and the torchrun
    baseline's fault-free run (logging to the same MLflow server); return the runs (the
    faulty one first) and the productive time (None without ETTR)."""
    schedule = fault_schedule(args["steps"])
    relay: dict[bool, tuple[Run, list[Path]]] = {}
    order = (True, False) if repeat % 2 else (False, True)  # a drift falls on each in turn
    for faulty in order if args["ettr"] else (True,):
        name = "relay with faults" if faulty else "relay fault-free"
        relay[faulty] = relay_run(api, home, schedule if faulty else [], args["timeout"], name)
        if faulty:
            print_run(relay[faulty][0])
        else:
            free = relay[faulty]
            print(f"    relay fault-free: {free[0].wall:.1f}s; {ends(*free)}", flush=True)
    if not args["ettr"]:
        return [relay[True][0]], None
    base = home / "baseline" / f"repeat-{repeat}"
    plain = _baseline_run(base, _job(args["steps"], args["every"]), [],
                          BASELINE_COLLECTIVE_TIMEOUT, tracking_uri)
    plain_attempts = baseline_attempts(base)
    pooled = seconds_per_step(relay[False][1] + plain_attempts)
    print_pace(relay[False][1], plain_attempts, relay[True][1], pooled)
    runs = [relay[True][0], relay[False][0], plain]
    productive = args["steps"] * pooled
    print(f"    ETTR (productive time {productive:.1f}s, total steps x the pooled seconds per "
          "step of the two fault-free loops): " + ", ".join(
              f"{r.name} {ettr(r, productive):.2f} ({r.wall:.1f}s)" for r in runs), flush=True)
    return runs, productive


def header(args: dict[str, Any], smoke: bool) -> str:
    """Say what is measured, on what, and how."""
    schedule = fault_schedule(args["steps"])
    return (
        f"Scheduled-recovery benchmark{' (SMOKE: too short for figures)' if smoke else ''}: "
        f"{args['steps']} steps, segments of {args['segment']}, checkpoint every "
        f"{args['every']}, 2 nodes x 2 ranks from a pool of {len(NODE_POOL)} nodes, "
        f"{args['repeats']} repeat(s)\n"
        "  Measured: fault -> first productive step (and its parts, decision.json "
        "`time_to_resume`), detection and lost steps, per fault, of Relay with the real "
        "Airflow services of `make up` (relay.tools.services: API server, scheduler, DAG processor "
        "and triggerer as separate processes, LocalExecutor, SQLite; an MLflow server; all on "
        "127.0.0.1 in a temporary home), the DAG run triggered through the REST API, "
        "policies/default.yaml, segment boundaries: adopt\n"
        f"  Schedule (relay bench goodput's, once each): stalled rank 1 at step "
        f"{schedule[0]['step']}; frozen node (SIGSTOP of its agent and ranks) hosting rank 2 at "
        f"step {schedule[1]['step']}; the node hosting rank 3 turns 3x slow at step "
        f"{schedule[2]['step']} and stays slow\n"
        "  Compared with: issue 12's goal (median <= 9.5s). `relay bench goodput` measures the "
        "same under `airflow dags test` (goal <= 7s)\n"
        + ("  ETTR: each repeat also triggers a fault-free DAG run and runs goodput's torchrun "
           "baseline fault-free (one torchrun per node, logging to the same MLflow server), "
           "the services running beside both; absolute ETTR = productive time / wall time, "
           "productive time = total steps x the pooled seconds per step of the two fault-free "
           "loops; a DAG run's wall time runs from the trigger request to the end Airflow "
           "recorded (goal: >= 0.9 fault-free)" if args["ettr"] else
           "  No fault-free run, no baseline, no ETTR (--no-ettr)"))


@contextmanager
def _bench_env(home: Path) -> Iterator[Path]:
    """Point Relay at a temporary home with the goodput job; restore the environment after."""
    saved = {k: os.environ.get(k) for k in ENV_VARS}
    jobs = home / "jobs"
    jobs.mkdir(parents=True)
    os.environ.update({"RELAY_HOME": str(home), "RELAY_JOBS_DIR": str(jobs),
                       "RELAY_NODES": ",".join(NODE_POOL)})
    os.environ.pop("RELAY_MLFLOW_TRACKING_URI", None)  # the deployment sets its own server's
    try:
        yield jobs
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_all(home: Path, args: dict[str, Any]) -> tuple[list[list[Run]], list[float]]:
    """Bring the services up in ``home``, run the repeats, always bring them down; return
    each repeat's runs (the faulty one first) and productive times (none without ETTR)."""
    all_runs: list[list[Run]] = []
    productives: list[float] = []
    with _bench_env(home) as jobs:
        (jobs / "goodput.yaml").write_text(_job_yaml(args["steps"], args["segment"],
                                                     args["every"]))
        began = time.monotonic()
        try:
            deployment = services.up(home)
            print(f"  services up in {time.monotonic() - began:.1f}s: Airflow "
                  f"{deployment.api_url}, MLflow {deployment.mlflow_url}", flush=True)
            api = AirflowApi(deployment.api_url, services.ADMIN_USER,
                             services.admin_password(home))
            for repeat in range(1, args["repeats"] + 1):
                print(f"  repeat {repeat}/{args['repeats']}:", flush=True)
                runs, productive = one_repeat(api, home, args, repeat, deployment.mlflow_url)
                all_runs.append(runs)
                if productive is not None:
                    productives.append(productive)
        finally:
            stopped = services.down(home)
            print(f"  services down: {len(stopped)} process(es) stopped", flush=True)
    return all_runs, productives


def _exit_on_signal(signum: int, _frame: object) -> None:
    sys.exit(128 + signum)


def bench_args(steps: int, segment: int, every: int, repeats: int, smoke: bool,
               timeout: float, ettr: bool = True) -> dict[str, Any]:
    """Return the run's settings; ``smoke`` takes goodput's short schedule and 1 repeat."""
    args: dict[str, Any] = {"steps": steps, "segment": segment, "every": every,
                            "repeats": repeats, "timeout": timeout, "ettr": ettr}
    if smoke:
        args.update({k: SMOKE[k] for k in ("steps", "segment", "every", "repeats")})
        args["timeout"] = min(timeout, 900.0)
    return args


def main(steps: int = 1200, segment: int = 300, every: int = 25, repeats: int = 1,
         smoke: bool = False, timeout: float = 1800.0, ettr: bool = True) -> int:
    """Run the repeats with the real services; print each fault's time to resume and,
    with ``ettr``, every run's ETTR."""
    args = bench_args(steps, segment, every, repeats, smoke, timeout, ettr)
    print(header(args, smoke), flush=True)
    home = Path(tempfile.mkdtemp(prefix="relay-bench-scheduled-"))
    # A SIGTERM (or SIGINT, even when a background shell ignores it) must bring the services
    # down too: raise SystemExit, so run_all's `finally` runs.
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM,
                                                                    signal.SIGINT)}
    try:
        all_runs, productives = run_all(home, args)
    except (RunFailed, ServiceError) as err:
        print(f"relay bench scheduled: {err}\n  (kept {home} for its logs; remove it when done)")
        return 1
    except (KeyboardInterrupt, SystemExit):
        print(f"relay bench scheduled: interrupted; services stopped; kept {home} for its logs")
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    shutil.rmtree(home, ignore_errors=True)
    print_summary(all_runs, productives)
    return 0
