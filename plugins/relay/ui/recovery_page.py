"""The Recovery page: a FastAPI app mounted by Airflow's API server under ``/relay/``.

Airflow does not put plugin apps behind its authentication, so every route
here resolves the user exactly as Airflow's own API does (``get_user``: the
``Authorization: Bearer`` JWT, else the UI's ``_token`` cookie) and asks the
auth manager whether that user may read the DAG's runs. No valid login: 401.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from relay.core import settings
from relay.core.attempt import AttemptState
from relay.ui.page_html import index_html, run_html

if TYPE_CHECKING:
    from relay.lineage.run_view import RunView
    from relay.lineage.store import Lineage

# Airflow imports its plugins (this page) in every component and in every `airflow dags
# test`, on its way to the first task: MLflow (lineage.store, lineage.run_view) is imported
# by the routes that read a run, when a request comes, not here (~1.6 s of CPU).

log = logging.getLogger(__name__)
PICTURES = ("timeline.png", "loss.png")
REFRESH_RUNNING_SECONDS = 10.0


async def current_user(request: Request) -> Any:  # noqa: ANN401 - an Airflow BaseUser
    """Return the logged-in user, as Airflow's API resolves it; refuse anyone else."""
    from airflow.api_fastapi.core_api.security import resolve_user_from_token

    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return await resolve_user_from_token(header.split(" ", 1)[1])
    from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN

    return await resolve_user_from_token(request.cookies.get(COOKIE_NAME_JWT_TOKEN))


UserDep = Annotated[Any, Depends(current_user)]


def _may_read_runs(user: Any, dag_id: str) -> None:  # noqa: ANN401
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import (
        DagAccessEntity,
        DagDetails,
    )

    allowed = get_auth_manager().is_authorized_dag(
        method="GET", access_entity=DagAccessEntity.RUN, details=DagDetails(id=dag_id), user=user)
    if not allowed:
        raise HTTPException(status_code=403, detail=f"not allowed to read runs of {dag_id}")


def _job_of(dag_id: str) -> str:
    if not dag_id.startswith("relay_"):
        raise HTTPException(status_code=404, detail=f"{dag_id} is not a Relay DAG")
    return dag_id.removeprefix("relay_")


def _lineage() -> Lineage:
    from relay.lineage.store import Lineage  # MLflow: at the first request, not at plugin load

    return Lineage.from_settings()


def _view(dag_id: str, run_id: str | None) -> tuple[Lineage, RunView]:
    from relay.lineage.run_view import find_parent, run_view

    lineage = _lineage()
    try:
        parent = find_parent(lineage, _job_of(dag_id), run_id)
    except LookupError as err:
        raise HTTPException(status_code=404, detail=str(err)) from err
    return lineage, run_view(lineage, parent)


def pictures_dir(parent_run_id: str) -> Path:
    """Return where the page keeps a run's rendered pictures."""
    return settings.relay_home() / "reports" / parent_run_id


def _ensure_pictures(lineage: Lineage, view: RunView) -> None:
    from relay.lineage.report_files import render

    out = pictures_dir(view.parent_run_id)
    stamp = out / "timeline.png"
    finished = view.outcome != AttemptState.RUNNING
    fresh = stamp.exists() and (
        finished or time.time() - stamp.stat().st_mtime < REFRESH_RUNNING_SECONDS)
    if not fresh:
        render(view, lineage, out)


def create_app() -> FastAPI:
    """Build the Recovery page's app (mounted at ``/relay``)."""
    app = FastAPI(title="Relay recovery", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def refuse(request: Request, exc: HTTPException) -> Any:  # noqa: ANN401
        if "text/html" in request.headers.get("accept", "") and exc.status_code in (401, 403):
            return HTMLResponse(
                f"<h1>{exc.status_code}: {exc.detail}</h1><p>Log in to Airflow first: "
                '<a href="/auth/login/?next=/relay/">log in</a>.</p>',
                status_code=exc.status_code)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    @app.get("/", response_class=HTMLResponse)
    def index(user: UserDep) -> str:
        from relay.lineage.run_view import dag_runs

        lineage = _lineage()
        jobs = sorted(p.stem for p in settings.jobs_dir().glob("*.yaml"))
        listing: dict[str, list[Any]] = {}
        for job in jobs:
            try:
                _may_read_runs(user, f"relay_{job}")
            except HTTPException:
                continue  # not this user's to see
            listing[job] = dag_runs(lineage, job)
        return index_html(listing)

    @app.get("/run", response_class=HTMLResponse)
    def run_page(user: UserDep, dag_id: Annotated[str, Query()],
                 run_id: Annotated[str | None, Query()] = None) -> str:
        _may_read_runs(user, dag_id)
        lineage, view = _view(dag_id, run_id)
        _ensure_pictures(lineage, view)
        return run_html(view)

    @app.get("/api/run")
    def run_json(user: UserDep, dag_id: Annotated[str, Query()],
                 run_id: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        _may_read_runs(user, dag_id)
        return _view(dag_id, run_id)[1].to_dict()

    @app.get("/picture/{dag_id}/{parent_run_id}/{name}")
    def picture(user: UserDep, dag_id: str, parent_run_id: str, name: str) -> FileResponse:
        _may_read_runs(user, dag_id)
        if name not in PICTURES or not parent_run_id.isalnum():
            raise HTTPException(status_code=404, detail="no such picture")
        path = pictures_dir(parent_run_id) / name
        if not path.exists():
            raise HTTPException(status_code=404, detail="picture not rendered yet")
        return FileResponse(path, media_type="image/png")

    return app
