"""Relay's notes in Airflow: the segment task's note and its DAG run's note.

Airflow 3 shows both notes in its grid and run pages, where a platform engineer looks
first. A running task cannot write them through the Execution API (the task's context
reads the DAG run's note, never writes it), so the segment task calls the REST API
(:meth:`~relay.core.airflow_api.AirflowApi.set_task_note`, ``set_run_note``) as the user
of the Airflow connection ``relay_airflow_api`` (HTTP: host, port, login, password; `make
up` sets it). Without that connection (``airflow dags test``) there are no notes.

The texts come from :mod:`relay.lineage.notes`, over the run's record read back from
MLflow as the Recovery page reads it. Writing a note never fails the task: a failure is
one warning in its log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from relay.core.airflow_api import NOTES_CONNECTION, AirflowApi

log = logging.getLogger(__name__)
NOTE_TIMEOUT_SECONDS = 10.0  # per API call: a note is not worth holding a recovery up


def notes_api() -> AirflowApi | None:
    """Return a client as the notes connection's user (None: the connection is not set)."""
    from airflow.sdk import Connection

    try:
        conn = Connection.get(NOTES_CONNECTION)
    except Exception as exc:  # noqa: BLE001 - not set (or no Airflow context): no notes
        log.debug("No Airflow connection %s (%s): Relay writes no notes", NOTES_CONNECTION, exc)
        return None
    scheme = conn.schema or "http"
    port = f":{conn.port}" if conn.port else ""
    return AirflowApi(f"{scheme}://{conn.host}{port}", conn.login or "", conn.password or "")


def write_notes(context: Any, lineage: Any, parent: Callable[[], str],  # noqa: ANN401
                segment: int) -> None:
    """Set the notes of this segment's task instance and of its DAG run from the run's
    faults so far (``parent``: how to find the DAG run's MLflow run; a segment or run
    without faults keeps its note). Never raises."""
    try:
        api = notes_api()
        if api is None:
            return
        from relay.lineage.notes import run_note, task_note
        from relay.lineage.run_view import run_view

        view = run_view(lineage, parent())
        ti, run_id = context["ti"], context["dag_run"].run_id
        note = task_note(view.faults, segment)
        if note is not None:
            api.set_task_note(ti.dag_id, run_id, ti.task_id, note, NOTE_TIMEOUT_SECONDS)
        summary = run_note(view.faults, view.summary().time_lost_seconds)
        if summary is not None:
            api.set_run_note(ti.dag_id, run_id, summary, NOTE_TIMEOUT_SECONDS)
    except Exception as exc:  # noqa: BLE001 - a note must never fail the segment
        log.warning("Could not write Relay's notes in Airflow (%s: %s); going on without",
                    type(exc).__name__, exc)
