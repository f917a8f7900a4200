"""Run test jobs through `airflow dags test` and find their MLflow parent run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from relay.airflow_env import airflow_env, ensure_airflow_db
from relay.demo import run_dag_test
from relay.lineage import TAG_DAG_ID, Lineage
from relay.nodes import NodePool


def use_jobs(relay_home: Path, jobs_dir: Path) -> dict[str, str]:
    """Point the DAG file at ``jobs_dir``, start from a healthy pool, prepare Airflow's DB."""
    os.environ["RELAY_JOBS_DIR"] = str(jobs_dir)
    pool = NodePool()
    for node in pool.quarantines():  # earlier tests' quarantines: start from a healthy pool
        pool.release(node)
    env = airflow_env(relay_home)
    ensure_airflow_db(env, relay_home / "logs" / "airflow-db.log")
    return env


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
