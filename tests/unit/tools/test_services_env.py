"""`make up`'s environment: loopback, free ports, PATH, unpaused DAGs, one shared secret."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from relay.core.exceptions import ServiceError
from relay.tools import services


def test_every_component_gets_the_venv_on_path_and_its_own_ports(tmp_path: Path,
                                                                   monkeypatch) -> None:
    monkeypatch.setenv("RELAY_API_PORT", "18080")
    monkeypatch.delenv("RELAY_MLFLOW_PORT", raising=False)
    ports = services.choose_ports()
    assert ports.api == 18080
    assert len({ports.api, ports.mlflow, ports.worker_logs, ports.trigger_logs}) == 4
    services.services_dir(tmp_path).mkdir(parents=True)
    env = services.services_env(tmp_path, ports)
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert env["AIRFLOW__API__HOST"] == "127.0.0.1"
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:18080/execution/"
    assert env["AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION"] == "False"
    assert env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] == str(ports.worker_logs)
    assert env["AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL"] == "1"
    assert env["RELAY_MLFLOW_TRACKING_URI"] == f"http://127.0.0.1:{ports.mlflow}"
    assert env["PYTHONPATH"].split(":")[0].endswith("/plugins")
    # The secret is made once and shared: a second environment carries the same one.
    again = services.services_env(tmp_path, ports)
    assert env["AIRFLOW__API_AUTH__JWT_SECRET"] == again["AIRFLOW__API_AUTH__JWT_SECRET"]
    assert len(env["AIRFLOW__API_AUTH__JWT_SECRET"]) >= 64
    cmd = services._mlflow_command(tmp_path, ports)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--workers" in cmd


def test_down_and_restart_without_a_deployment(tmp_path: Path) -> None:
    assert services.down(tmp_path) == []
    with pytest.raises(ServiceError, match="no running scheduler recorded"):
        services.restart("scheduler", tmp_path)


def test_the_tasks_write_notes_as_a_user_whose_password_airflow_keeps(tmp_path: Path) -> None:
    """The notes user's password is in the simple auth manager's file before the API server
    starts (it keeps what it finds there), and in the connection every task reads."""
    import json

    sdir = services.services_dir(tmp_path)
    sdir.mkdir(parents=True)
    (sdir / "passwords.json").write_text(json.dumps({"admin": "kept"}))
    ports = services.choose_ports()

    env = services.services_env(tmp_path, ports)

    assert "relay:user" in env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"].split(",")
    conn = json.loads(env["AIRFLOW_CONN_RELAY_AIRFLOW_API"])
    saved = json.loads((sdir / "passwords.json").read_text())
    assert saved == {"admin": "kept", "relay": conn["password"]}
    assert (conn["host"], conn["port"], conn["login"]) == ("127.0.0.1", ports.api, "relay")
    again = json.loads(services.services_env(tmp_path, ports)["AIRFLOW_CONN_RELAY_AIRFLOW_API"])
    assert again["password"] == conn["password"]
