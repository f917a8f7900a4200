"""The Recovery page: a FastAPI app mounted by Airflow's API server under ``/relay/``.

Airflow does not put plugin apps behind its authentication, so every route
here resolves the user exactly as Airflow's own API does (``get_user``: the
``Authorization: Bearer`` JWT, else the UI's ``_token`` cookie) and asks the
auth manager whether that user may read the DAG's runs. No valid login: 401.

Anyone who can write to MLflow writes what this page shows, and anyone can send it
a link: pages render through autoescaping templates (``relay.ui.page_html``),
error responses carry fixed texts (never the request's input, never the MLflow
tracking URI, which may hold database credentials), every response carries a
Content-Security-Policy that allows no script at all (a running run's page reloads
by a meta refresh), and no route writes to MLflow (no get-or-create: a job without
records reads as "no runs").
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from relay.core import settings
from relay.core.attempt import AttemptState
from relay.ui.page_html import (
    PICTURE_NAMES,
    REFRESH_SECONDS,
    error_html,
    index_html,
    run_html,
)
from relay_train.protocol.heartbeat import write_atomically

if TYPE_CHECKING:
    from relay.lineage.run_view import RunSummary, RunView
    from relay.lineage.store import Lineage

# Airflow imports its plugins (this page) in every component and in every `airflow dags
# test`, on its way to the first task: MLflow (lineage.store, lineage.run_view) is imported
# by the routes that read a run, when a request comes, not here (~1.6 s of CPU).

log = logging.getLogger(__name__)
PICTURES = tuple(f"{name}.png" for name in PICTURE_NAMES)
INDEX_RUNS = 20  # the newest DAG runs of each job the index lists, with their figures
SUMMARY_FILE = "summary.json"  # an ended run's figures, beside its pictures
# Airflow's default `allowed_run_id_pattern`: a run id outside it was never recorded, and
# the rest is safe inside an MLflow filter string's quotes.
RUN_ID = re.compile(r"[A-Za-z0-9_.~:+-]{1,250}")

# Every error the page answers with: fixed texts, never what the request sent.
NOT_LOGGED_IN = "Not logged in. Log in to Airflow first."
NOT_ALLOWED = ("Not allowed: your Airflow login may not read this DAG's runs, or it is no "
               "longer valid. Log in again, or ask an Airflow admin for access.")
NOT_RELAY = "Not found: that DAG is not a Relay DAG (a Relay DAG is named relay_JOB)."
NO_RECORD = ("Not found: Relay has no record of that DAG run. Check the DAG id and run id, "
             "or open the list of runs at /relay/.")
NO_PICTURE = "Not found: no such picture (it appears once the run's page has been opened)."
BAD_REQUEST = ("Bad request: expected the query parameter dag_id, and optionally run_id, "
               "as the Recovery links in Airflow's UI give them.")
FAILED = "The Recovery page failed to read this run; the API server's log says why."
FIXED_TEXTS = {NOT_LOGGED_IN, NOT_ALLOWED, NOT_RELAY, NO_RECORD, NO_PICTURE, BAD_REQUEST, FAILED}
BY_STATUS = {401: NOT_LOGGED_IN, 403: NOT_ALLOWED, 404: "Not found.", 405: "Method not allowed.",
             422: BAD_REQUEST, 500: FAILED}


def content_security_policy(nonce: str) -> str:
    """Return the page's policy: no script, no plugins, styles only by ``nonce``, images
    and framing (Airflow's UI embeds the page) from this origin only."""
    return (f"default-src 'none'; style-src 'nonce-{nonce}'; img-src 'self'; "
            "base-uri 'none'; form-action 'none'; frame-ancestors 'self'")


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
        raise HTTPException(status_code=403, detail=NOT_ALLOWED)


def _job_of(dag_id: str) -> str:
    if not dag_id.startswith("relay_"):
        raise HTTPException(status_code=404, detail=NOT_RELAY)
    return dag_id.removeprefix("relay_")


def _lineage() -> Lineage | None:
    """Return the lineage store, or None while there is none: opening a missing SQLite
    store would create it, and a GET never writes."""
    from relay.lineage.store import Lineage  # MLflow: at the first request, not at plugin load

    lineage = Lineage.from_settings()
    uri = lineage.tracking_uri
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return None
    return lineage


def _view(dag_id: str, run_id: str | None) -> tuple[Lineage, RunView]:
    from relay.lineage.run_view import find_parent, run_view

    job = _job_of(dag_id)
    lineage = _lineage()
    if lineage is None or (run_id is not None and not RUN_ID.fullmatch(run_id)):
        raise HTTPException(status_code=404, detail=NO_RECORD)
    try:
        parent = find_parent(lineage, job, run_id)
    except LookupError as err:  # its text names the tracking URI: the log only
        log.info("Recovery page: %s", err)
        raise HTTPException(status_code=404, detail=NO_RECORD) from err
    return lineage, run_view(lineage, parent)


def _nonce(request: Request) -> str:
    return str(request.state.csp_nonce)


def _refusal(request: Request, status: int, detail: object) -> Response:
    """Answer an error with a fixed text: the page's own, else the one of its status."""
    text = detail if isinstance(detail, str) and detail in FIXED_TEXTS else (
        BY_STATUS.get(status, "Request failed."))
    if "text/html" in request.headers.get("accept", ""):
        return HTMLResponse(error_html(status, text, _nonce(request)), status_code=status)
    return JSONResponse({"detail": text}, status_code=status)


def _guard(app: FastAPI) -> None:
    """Put the policy headers on every response and fixed texts on every error."""

    @app.middleware("http")
    async def policy_headers(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        request.state.csp_nonce = secrets.token_urlsafe(16)
        try:
            response = await call_next(request)
        except Exception:  # a bare 500 from the server would bypass the headers below
            log.exception("Recovery page: %s failed", request.url.path)
            response = _refusal(request, 500, FAILED)
        response.headers["Content-Security-Policy"] = content_security_policy(_nonce(request))
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        return response

    @app.exception_handler(StarletteHTTPException)
    async def refuse(request: Request, exc: StarletteHTTPException) -> Response:
        return _refusal(request, exc.status_code, exc.detail)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> Response:
        return _refusal(request, 422, BAD_REQUEST)


def pictures_dir(parent_run_id: str) -> Path:
    """Return where the page keeps a run's rendered pictures."""
    return settings.relay_home() / "reports" / parent_run_id


def _ensure_pictures(lineage: Lineage, view: RunView) -> None:
    from relay.lineage.report_files import render

    out = pictures_dir(view.parent_run_id)
    stamp = out / PICTURES[-1]  # the last one render() writes
    finished = view.outcome != AttemptState.RUNNING
    fresh = stamp.exists() and (
        finished or time.time() - stamp.stat().st_mtime < REFRESH_SECONDS)
    if not fresh:
        render(view, lineage, out)


def _summary(lineage: Lineage | None, run: Any) -> RunSummary | None:  # noqa: ANN401 - a Run
    """Return a DAG run's figures at a glance; kept beside its pictures once the run has
    ended (an ended run's figures do not change unless it runs again: its end time is the
    key). None: its record is not readable (the run's page says why)."""
    from relay.lineage.run_view import RunSummary, run_view

    key = f"{run.info.status}:{run.info.end_time}"
    kept = pictures_dir(run.info.run_id) / SUMMARY_FILE
    try:
        found = json.loads(kept.read_text()) if kept.exists() else {}
        if found.get("key") == key:
            return RunSummary(**found["summary"])
    except (OSError, ValueError, TypeError, KeyError):
        pass  # computed again below
    try:
        view = run_view(lineage, run.info.run_id)
    except Exception:  # noqa: BLE001 - one unreadable run must not hide the others
        log.exception("Recovery index: could not read MLflow run %s", run.info.run_id)
        return None
    summary = view.summary()
    if run.info.end_time:
        kept.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(kept, json.dumps({"key": key, "summary": asdict(summary)}))
    return summary


def create_app() -> FastAPI:
    """Build the Recovery page's app (mounted at ``/relay``)."""
    app = FastAPI(title="Relay recovery", docs_url=None, redoc_url=None, openapi_url=None)

    _guard(app)

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request, user: UserDep) -> str:
        from relay.lineage.run_view import dag_runs

        lineage = _lineage()
        jobs = sorted(p.stem for p in settings.jobs_dir().glob("*.yaml"))
        listing: dict[str, list[Any]] = {}
        summaries: dict[str, RunSummary | None] = {}
        for job in jobs:
            try:
                _may_read_runs(user, f"relay_{job}")
            except HTTPException:
                continue  # not this user's to see
            listing[job] = [] if lineage is None else dag_runs(lineage, job, INDEX_RUNS)
            for run in listing[job]:
                summaries[run.info.run_id] = _summary(lineage, run)
        return index_html(listing, summaries, _nonce(request))

    @app.get("/run", response_class=HTMLResponse)
    def run_page(request: Request, user: UserDep, dag_id: Annotated[str, Query()],
                 run_id: Annotated[str | None, Query()] = None) -> str:
        _may_read_runs(user, dag_id)
        lineage, view = _view(dag_id, run_id)
        _ensure_pictures(lineage, view)
        return run_html(view, _nonce(request), dag_id)

    @app.get("/api/run")
    def run_json(user: UserDep, dag_id: Annotated[str, Query()],
                 run_id: Annotated[str | None, Query()] = None) -> dict[str, Any]:
        _may_read_runs(user, dag_id)
        return _view(dag_id, run_id)[1].to_dict()

    @app.get("/picture/{dag_id}/{parent_run_id}/{name}")
    def picture(user: UserDep, dag_id: str, parent_run_id: str, name: str) -> FileResponse:
        _may_read_runs(user, dag_id)
        if name not in PICTURES or not parent_run_id.isalnum():
            raise HTTPException(status_code=404, detail=NO_PICTURE)
        path = pictures_dir(parent_run_id) / name
        if not path.exists():
            raise HTTPException(status_code=404, detail=NO_PICTURE)
        return FileResponse(path, media_type="image/png")

    return app
