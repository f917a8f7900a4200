"""A small client of Airflow 3's REST API (token, health, DAGs, DAG runs, notes).

Here, at the bottom, because both the `relay` command (``relay up``, the benchmarks)
and the segment task (its notes: :mod:`relay.operators.airflow_notes`) talk to the API.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import requests

from relay.core.exceptions import ServiceError

RELAY_DAG_TAG = "relay"
# The Airflow connection (HTTP: host, port, login, password) a segment task writes its
# notes with; `make up` sets it (AIRFLOW_CONN_RELAY_AIRFLOW_API). Not set: no notes.
NOTES_CONNECTION = "relay_airflow_api"


class AirflowApi:
    """Talk to one Airflow API server as one simple-auth-manager user."""

    def __init__(self, base_url: str, username: str, password: str) -> None:
        """Talk to ``base_url`` (e.g. ``http://127.0.0.1:8080``) as ``username``."""
        self.base_url = base_url.rstrip("/")
        self.username = username
        self.password = password
        self._token: str | None = None

    def token(self) -> str:
        """Return a JWT for the user (``POST /auth/token``), cached."""
        if self._token is None:
            resp = requests.post(f"{self.base_url}/auth/token", timeout=10,
                                 json={"username": self.username, "password": self.password})
            if resp.status_code >= 400:
                raise ServiceError(f"login as {self.username} refused: HTTP {resp.status_code} "
                                   f"{resp.text[:200]}")
            self._token = str(resp.json()["access_token"])
        return self._token

    def _call(self, method: str, path: str, timeout: float = 60.0,
              **kwargs: Any) -> Any:  # noqa: ANN401 - JSON
        # One API server worker on a loaded 2-core machine can take a while to answer.
        resp = requests.request(method, f"{self.base_url}/api/v2{path}", timeout=timeout,
                                headers={"Authorization": f"Bearer {self.token()}"}, **kwargs)
        if resp.status_code >= 400:
            raise ServiceError(f"{method} {path}: HTTP {resp.status_code} {resp.text[:300]}")
        return resp.json() if resp.content else None

    def health(self) -> dict[str, Any]:
        """Return ``/api/v2/monitor/health`` (no login needed)."""
        resp = requests.get(f"{self.base_url}/api/v2/monitor/health", timeout=5)
        resp.raise_for_status()
        return dict(resp.json())

    def relay_dags_paused(self) -> dict[str, bool]:
        """Return ``{dag_id: is_paused}`` for every DAG tagged ``relay``."""
        found = self._call("GET", "/dags", params={"tags": RELAY_DAG_TAG, "limit": 100})
        return {d["dag_id"]: bool(d["is_paused"]) for d in found["dags"]}

    def unpause(self, dag_id: str) -> None:
        """Unpause one DAG."""
        self._call("PATCH", f"/dags/{dag_id}", json={"is_paused": False})

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        """Trigger a DAG run with ``conf``; return its run id."""
        run = self._call("POST", f"/dags/{dag_id}/dagRuns",
                         json={"logical_date": None, "conf": conf})
        return str(run["dag_run_id"])

    def dag_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        """Return one DAG run."""
        return dict(self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}"))

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        """Return the task instances of one DAG run."""
        found = self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
        return list(found["task_instances"])

    def set_run_note(self, dag_id: str, run_id: str, note: str, timeout: float = 60.0) -> None:
        """Set a DAG run's note (``PATCH .../dagRuns/{run_id}``, ``update_mask=note``)."""
        self._call("PATCH", f"/dags/{quote(dag_id, safe='')}/dagRuns/{quote(run_id, safe='')}",
                   timeout=timeout, params={"update_mask": "note"}, json={"note": note})

    def set_task_note(self, dag_id: str, run_id: str, task_id: str, note: str,
                      timeout: float = 60.0) -> None:
        """Set a task instance's note, which Airflow keeps across its tries
        (``PATCH .../taskInstances/{task_id}``, ``update_mask=note``)."""
        path = (f"/dags/{quote(dag_id, safe='')}/dagRuns/{quote(run_id, safe='')}"
                f"/taskInstances/{quote(task_id, safe='')}")
        self._call("PATCH", path, timeout=timeout, params={"update_mask": "note"},
                   json={"note": note})
