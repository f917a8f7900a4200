"""Unit tests for Relay's notes in Airflow: the REST calls, and that a note never fails a task.

A loopback HTTP server stands in for Airflow's API server: the test checks the calls
Airflow 3's REST API expects (``PATCH`` with ``update_mask=note``, the run id quoted).
"""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from local_http import send_json, serving

from relay.core.airflow_api import NOTES_CONNECTION
from relay.lineage import run_view
from relay.lineage.report import FaultRow
from relay.operators import airflow_notes

RUN_ID = "manual__2026-12-06T21:55:12.268607+00:00"
ROW = FaultRow(0, "hang", "rank 1, node-a", 2.0, "restart_elsewhere", 0, 5.6, try_number=1,
               rank=1, node="node-a", rule="rules.hang", retry=True, step=35, resume_step=35,
               retry_nodes=["node-b", "node-c"])
CONTEXT = {"ti": SimpleNamespace(dag_id="relay_e2e", task_id="segment_000"),
           "dag_run": SimpleNamespace(run_id=RUN_ID)}


def _record(monkeypatch: pytest.MonkeyPatch, rows: list[FaultRow]) -> None:
    """Have the run's record (as the Recovery page reads it) hold ``rows``."""
    view = SimpleNamespace(faults=rows,
                           summary=lambda: SimpleNamespace(time_lost_seconds=7.0))
    monkeypatch.setattr(run_view, "run_view", lambda lineage, parent: view)


def _airflow(calls: list[dict[str, Any]], status: int = 200) -> type[BaseHTTPRequestHandler]:
    class FakeAirflow(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the token
            self.rfile.read(int(self.headers["Content-Length"]))
            send_json(self, 200, {"access_token": "t"})

        def do_PATCH(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append({"path": self.path, "body": body,
                          "auth": self.headers["Authorization"]})
            send_json(self, status, {})

        def log_message(self, *args: object) -> None:
            pass

    return FakeAirflow


def _connect(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    monkeypatch.setenv(f"AIRFLOW_CONN_{NOTES_CONNECTION.upper()}", json.dumps(
        {"conn_type": "http", "host": host, "port": int(port), "login": "relay",
         "password": "secret-pw"}))


def test_the_task_and_the_run_get_their_notes_through_the_rest_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[dict[str, Any]] = []
    _record(monkeypatch, [ROW])
    with serving(_airflow(calls)) as url:
        _connect(monkeypatch, url)
        airflow_notes.write_notes(CONTEXT, None, lambda: "parent", 0)

    quoted = "manual__2026-12-06T21%3A55%3A12.268607%2B00%3A00"
    assert [c["path"] for c in calls] == [
        f"/api/v2/dags/relay_e2e/dagRuns/{quoted}/taskInstances/segment_000?update_mask=note",
        f"/api/v2/dags/relay_e2e/dagRuns/{quoted}?update_mask=note",
    ]
    assert calls[0]["body"]["note"].startswith("Recovered: hang of rank 1 on node-a")
    assert calls[1]["body"]["note"].startswith(
        "Relay: 1 fault (hang); 0 steps lost; 7.0s of training time lost")
    assert {c["auth"] for c in calls} == {"Bearer t"}


def test_a_fault_free_segment_and_run_keep_their_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    _record(monkeypatch, [])
    with serving(_airflow(calls)) as url:
        _connect(monkeypatch, url)
        airflow_notes.write_notes(CONTEXT, None, lambda: "parent", 0)
    assert calls == []


def test_a_refused_or_unreachable_api_is_one_warning_never_a_failure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path,
) -> None:
    _record(monkeypatch, [ROW])
    with serving(_airflow([], status=403)) as url:
        _connect(monkeypatch, url)
        with caplog.at_level(logging.WARNING, logger=airflow_notes.__name__):
            airflow_notes.write_notes(CONTEXT, None, lambda: "parent", 0)
    assert "Could not write Relay's notes in Airflow (ServiceError: PATCH" in caplog.text

    def mlflow_down() -> str:
        raise ConnectionError("MLflow is down")

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=airflow_notes.__name__):
        airflow_notes.write_notes(CONTEXT, None, mlflow_down, 0)
    assert "(ConnectionError: MLflow is down)" in caplog.text


def test_without_the_connection_there_are_no_notes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(f"AIRFLOW_CONN_{NOTES_CONNECTION.upper()}", raising=False)
    assert airflow_notes.notes_api() is None
