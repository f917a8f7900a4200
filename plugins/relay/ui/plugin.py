"""Relay's Airflow plugin: the Recovery page under /relay/, linked from runs and task instances."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from relay.ui import warm
from relay.ui.recovery_page import create_app

# Relative hrefs open inside the Airflow UI; {DAG_ID} and {RUN_ID} are filled in by it.
RUN_PAGE = "relay/run?dag_id={DAG_ID}&run_id={RUN_ID}"


class RelayPlugin(AirflowPlugin):
    """The Recovery page (a FastAPI app) and its links in the Airflow UI; a listener that
    warms the scheduler (:mod:`relay.ui.warm`)."""

    name = "relay"
    listeners = [warm]
    fastapi_apps = [{"app": create_app(), "url_prefix": "/relay", "name": "Relay recovery"}]
    external_views = [
        {"name": "Recovery", "href": "relay/", "destination": "nav", "url_route": "relay"},
        {"name": "Recovery", "href": RUN_PAGE, "destination": "dag_run",
         "url_route": "relay-run"},
        {"name": "Recovery", "href": RUN_PAGE, "destination": "task_instance",
         "url_route": "relay-ti"},
    ]
