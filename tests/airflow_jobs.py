"""Running job specs through `airflow dags test` and reading what they left in MLflow."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from processes import workload_processes

from relay.core import settings
from relay.launchers.local.prestart import residents_dir
from relay.lineage.report import first_step_at
from relay.lineage.resume_time import preflight_started_at
from relay.lineage.store import TAG_DAG_ID, TAG_OUTCOME, TAG_SEGMENT, Lineage
from relay.nodes.pool import NodePool
from relay.tools.airflow_env import airflow_env, ensure_airflow_db
from relay.tools.demo import run_dag_test
from relay_train.agent.resident import RESIDENT_DIR


def use_jobs(relay_home: Path, jobs_dir: Path) -> dict[str, str]:
    """Point the DAG file at ``jobs_dir``, start from a healthy pool, prepare Airflow's DB."""
    os.environ["RELAY_JOBS_DIR"] = str(jobs_dir)
    free_the_pool()
    env = airflow_env(relay_home)
    ensure_airflow_db(env, relay_home / "logs" / "airflow-db.log")
    return env


def free_the_pool() -> None:
    """Start from a healthy, free pool: release the quarantines and the leases earlier
    runs left (a lease outlives a run whose task was killed, for LEASE_SECONDS); a test
    whose faults name a node must get that node."""
    pool = NodePool()
    for node in pool.quarantines():
        pool.release(node)
    for holder in {lease["holder"] for lease in pool.leases().values()}:
        pool.release_lease(holder)


def run_job(env: dict[str, str], relay_home: Path, job: str, conf: dict[str, Any],
            name: str, timeout_seconds: float = 300) -> tuple[int, str]:
    """Run a DAG run of ``job`` (log ``logs/<name>.log``); return its exit code and MLflow run."""
    dag_id = f"relay_{job}"
    proc = run_dag_test(dag_id, conf, env, relay_home / "logs" / f"{name}.log")
    try:
        code = proc.wait(timeout=timeout_seconds)
    finally:
        if proc.poll() is None:
            proc.kill()
    lineage = Lineage.from_settings()
    runs = lineage.client.search_runs(
        [lineage.experiment_id(job)], filter_string=f"tags.`{TAG_DAG_ID}` = '{dag_id}'",
        order_by=["attributes.start_time DESC"], max_results=1,
    )
    return code, str(runs[0].info.run_id)


def prepare_jobs(relay_home: Path, folder: Path, specs: dict[str, str]) -> dict[str, str]:
    """Write job specs (name -> YAML) into ``folder`` and :func:`use_jobs` it."""
    for name, text in specs.items():
        (folder / f"{name}.yaml").write_text(text)
    return use_jobs(relay_home, folder)


def run_job_ok(env: dict[str, str], relay_home: Path, job: str, conf: dict[str, Any],
               name: str) -> str:
    """Run a DAG run of ``job`` that must succeed; return its parent MLflow run id."""
    code, parent = run_job(env, relay_home, job, conf, name, timeout_seconds=400)
    log_file = relay_home / "logs" / f"{name}.log"
    assert code == 0, f"airflow dags test failed; see {log_file}:\n" + \
        log_file.read_text()[-4000:]
    run_dir = max((settings.runs_dir() / f"relay_{job}").iterdir(), key=lambda p: p.stat().st_mtime)
    started = preflight_started_at(run_dir)  # where Airflow's start-up ends and Relay's begins
    assert started is not None, f"preflight recorded no start in {run_dir}"
    first = first_step_at(run_dir / "segment-000" / "try-1")
    assert first is None or started < first, (started, first)
    _assert_prestarted_resident_taken_and_gone(run_dir)
    return parent


def _assert_prestarted_resident_taken_and_gone(run_dir: Path) -> None:
    """The run's resident was the one run_dag_test prestarted, and it is gone once the
    run is over (stopped by the run's end, or by run_dag_test's wait)."""
    link = run_dir / RESIDENT_DIR
    if not link.exists() and not link.is_symlink():
        return  # the first segment had no nodes at preflight: no resident was started
    assert link.is_symlink() and link.resolve().parent == residents_dir().resolve(), \
        f"{link}: preflight started a resident of its own instead of taking the prestarted one"
    deadline = time.monotonic() + 30  # SIGTERMed by the run's end or by run_dag_test's wait
    # (its forks, standbys and their ranks, keep its command line: none may be left either)
    while left := list(workload_processes(link.resolve()).values()):
        assert time.monotonic() < deadline, f"the prestarted resident outlived its run: {left}"
        time.sleep(0.1)


def final_state(lineage: Lineage, parent: str, where: Path, steps: list[int]) -> dict[str, Any]:
    """Check the checkpoint chain runs through ``steps`` (newest first); load the newest."""
    chain = [m.step for m in lineage.chain(parent)]
    assert chain[0] == steps[0] and chain[-1] == steps[-1], f"unexpected chain {chain}"
    assert chain == sorted(chain, reverse=True)
    verified = lineage.latest_valid_checkpoint(parent, where)
    assert verified is not None and verified.manifest.step == steps[0]
    return torch.load(verified.path, weights_only=True)


def assert_same_bits(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Assert two checkpoints hold identical weights and optimizer state."""
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), f"weights differ at {key}"
    for pa, pb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(),
                      strict=True):
        assert all(torch.equal(pa[k], pb[k]) for k in pa), "optimizer state differs"


def fault_records(lineage: Lineage, parent: str, where: Path) -> dict[str, dict[str, Any]]:
    """Return each faulty attempt's decision.json, by segment."""
    found = {}
    for child in lineage.child_runs(parent):
        if child.data.tags[TAG_OUTCOME] == "faulted":
            path = lineage.client.download_artifacts(child.info.run_id, "decision.json",
                                                     str(where / child.info.run_id))
            found[child.data.tags[TAG_SEGMENT]] = json.loads(Path(path).read_text())
    return found


