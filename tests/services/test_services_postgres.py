"""`make up` with Airflow's metadata in PostgreSQL (Debian's package, a private cluster).

Real processes: PostgreSQL 15, Airflow's components, the MLflow server, 4-rank DDP.
`make test-postgres`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
from airflow_runs import DAG_ID, run_to_end
from processes import workload_processes

from relay.core.airflow_api import AirflowApi
from relay.core.proctree import alive
from relay.tools import services

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def deployment(relay_home: Path) -> Iterator[services.Deployment]:
    home = relay_home / "svc-pg"
    saved = {k: os.environ.get(k) for k in ("RELAY_METADATA_DB", "RELAY_MLFLOW_TRACKING_URI")}
    os.environ["RELAY_METADATA_DB"] = "postgres"
    dep = services.up(home)
    os.environ["RELAY_MLFLOW_TRACKING_URI"] = dep.mlflow_url
    try:
        yield dep
    finally:
        services.down(home)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert not alive(dep.postgres_pid), "PostgreSQL outlived make down"
    assert not [p for p in dep.pids.values() if alive(p)]
    assert not workload_processes(home)


def test_a_run_through_airflow_on_postgres(deployment: services.Deployment) -> None:
    assert deployment.postgres_pid and deployment.ports.postgres
    api = AirflowApi(deployment.api_url, services.ADMIN_USER,
                     services.admin_password(Path(deployment.home)))
    run_id = run_to_end(api, {"chaos": []})
    # The run is in PostgreSQL, where Airflow was told to keep its metadata.
    conn = psycopg2.connect(host="127.0.0.1", port=deployment.ports.postgres, user="postgres",
                            dbname="airflow")
    try:
        with conn.cursor() as cur:
            cur.execute("select state from dag_run where dag_id = %s and run_id = %s",
                        (DAG_ID, run_id))
            assert cur.fetchone() == ("success",)
    finally:
        conn.close()
