"""Drive DAG runs of relay_demo through Airflow's REST API (helpers of the services tests)."""

from __future__ import annotations

import time
from typing import Any

import requests

from relay.core.airflow_api import AirflowApi

DAG_ID = "relay_demo"


def run_to_end(api: AirflowApi, conf: dict[str, Any], timeout: float = 900) -> str:
    """Trigger relay_demo with ``conf``, wait until it ends, require success; return the run id."""
    run_id = api.trigger(DAG_ID, conf)
    wait_for_success(api, run_id, timeout)
    return run_id


def wait_for_success(api: AirflowApi, run_id: str, timeout: float = 900) -> None:
    """Wait until a run of relay_demo ends; fail with its task states unless it succeeded."""
    deadline = time.monotonic() + timeout
    state = "queued"
    while time.monotonic() < deadline:
        try:
            state = api.dag_run(DAG_ID, run_id)["state"]
        except requests.RequestException:
            time.sleep(1)
            continue  # a busy API server; ask again
        if state in ("success", "failed"):
            break
        time.sleep(3)
    tries = {t["task_id"]: (t["state"], t["try_number"]) for t in
             api.task_instances(DAG_ID, run_id)}
    assert state == "success", f"DAG run {run_id} ended {state}: {tries}"


PASSED = {"success", "failed", "up_for_retry", "upstream_failed", "skipped"}


def wait_for_task_state(api: AirflowApi, run_id: str, task_id: str, states: set[str],
                         timeout: float = 600) -> str:
    """Wait until one task instance of a run is in one of ``states``."""
    tis: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            tis = {t["task_id"]: t["state"] for t in api.task_instances(DAG_ID, run_id)}
        except requests.RequestException:
            time.sleep(1)
            continue
        if tis.get(task_id) in states:
            return str(tis[task_id])
        if tis.get(task_id) in PASSED:
            break  # it went past the states waited for: say so now, not after the timeout
        time.sleep(1)
    raise AssertionError(f"{task_id} of {run_id} never reached {states}: {tis}")
