"""The Recovery page refuses anyone Airflow's API would refuse, and serves a logged-in user.

Real pieces: Airflow's own auth manager (simple), its JWT signer and validator, and
the page's FastAPI app; only the HTTP server is replaced by FastAPI's TestClient.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("AIRFLOW__API_AUTH__JWT_SECRET", "relay-unit-test-secret-" + "x" * 64)

from fastapi.testclient import TestClient  # noqa: E402


@pytest.fixture(scope="module")
def client(relay_home) -> TestClient:
    from airflow.api_fastapi.app import init_auth_manager

    from relay.tools.airflow_env import ensure_airflow_db
    from relay.ui.recovery_page import create_app

    # Airflow checks each token against its revoked-token table.
    ensure_airflow_db(dict(os.environ), relay_home / "logs" / "airflow-db.log")
    init_auth_manager()
    return TestClient(create_app())


def _token(role: str | None) -> str:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="u", role=role))


@pytest.mark.parametrize("path", ["/", "/run?dag_id=relay_demo", "/api/run?dag_id=relay_demo",
                                  "/picture/relay_demo/abc/timeline.png"])
def test_without_login_every_route_is_refused(client: TestClient, path: str) -> None:
    assert client.get(path).status_code == 401


def test_a_forged_token_is_refused(client: TestClient) -> None:
    resp = client.get("/", headers={"Authorization": "Bearer not.a.jwt"})
    assert resp.status_code == 403
    client.cookies.set("_token", "not.a.jwt")
    try:
        assert client.get("/").status_code == 403
    finally:
        client.cookies.clear()


def test_a_browser_without_login_is_told_to_log_in(client: TestClient) -> None:
    resp = client.get("/", headers={"Accept": "text/html"})
    assert resp.status_code == 401
    assert "/auth/login" in resp.text


def test_a_user_without_a_role_may_not_read_runs(client: TestClient) -> None:
    resp = client.get("/api/run?dag_id=relay_demo",
                      headers={"Authorization": f"Bearer {_token(None)}"})
    assert resp.status_code == 403


def test_a_logged_in_viewer_gets_the_page(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RELAY_JOBS_DIR", raising=False)  # the repository's jobs (demo)
    token = _token("VIEWER")
    client.cookies.set("_token", token)  # the UI's login cookie
    try:
        resp = client.get("/")
    finally:
        client.cookies.clear()
    assert resp.status_code == 200, resp.text
    assert "Job demo" in resp.text
    # A DAG run Relay never recorded: a clear 404 with a fixed text (it never echoes input).
    resp = client.get("/api/run?dag_id=relay_demo&run_id=nope",
                      headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 404
    assert "no record of that DAG run" in resp.json()["detail"]
    assert "nope" not in resp.text
    resp = client.get("/api/run?dag_id=example_bash", headers={"Authorization": f"Bearer {token}"})
    assert resp.status_code == 404


def test_loading_the_plugin_and_parsing_the_dags_leaves_mlflow_out() -> None:
    """Airflow imports its plugins in every component and in every `airflow dags test`
    on its way to the first task, and parses the DAG folder often: MLflow (~1.6 s of
    imports) must wait for the first route, preflight or segment that reads a run. In a
    new interpreter, since this one may have imported MLflow already."""
    import subprocess
    import sys

    code = ("import sys, relay.ui.plugin, relay.operators.dag_factory; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow'))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=120)

    assert found.stdout.strip() == "[]", found.stdout[-500:]


def test_only_a_scheduler_that_forks_the_task_processes_imports_mlflow_at_start() -> None:
    """relay.ui.warm: the scheduler of a LocalExecutor deployment, and nothing else (a task
    process forked from it keeps its argv but starts a task runner, not a Job)."""
    from airflow.jobs.job import Job

    from relay.ui import warm
    from relay.ui.plugin import RelayPlugin

    job, runner = Job.__new__(Job), type("TaskRunnerMarker", (), {})()
    assert warm in RelayPlugin.listeners
    assert warm.forks_tasks(job, ["/x/airflow", "scheduler"], "LocalExecutor")
    assert warm.forks_tasks(job, ["airflow", "scheduler", "-n", "5"],
                            "airflow.executors.local_executor.LocalExecutor")
    assert not warm.forks_tasks(runner, ["airflow", "scheduler"], "LocalExecutor")
    assert not warm.forks_tasks(job, ["airflow", "triggerer"], "LocalExecutor")
    assert not warm.forks_tasks(job, ["airflow", "dag-processor"], "LocalExecutor")
    assert not warm.forks_tasks(job, ["airflow", "dags", "test", "relay_demo"], "LocalExecutor")
    assert not warm.forks_tasks(job, ["airflow", "scheduler"], "CeleryExecutor")
