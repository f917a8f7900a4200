"""The Recovery page runs no script that MLflow's records or a link carry, and leaks nothing.

Real pieces: the page's FastAPI app under ``/relay`` on a uvicorn server on 127.0.0.1,
Airflow's own auth manager and JWTs, a real MLflow SQLite store seeded through Relay's
lineage with script payloads in every field the page shows (fault summary, culprit,
node names, run ids, decision, quarantines), and Debian's headless Chromium loading the
pages. A payload that ran would set ``document.title``; one that became markup would
leave a ``[data-pwn]`` element or a ``<script>`` in the DOM (the check that does not lean
on the Content-Security-Policy, which would also stop it).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest

os.environ.setdefault("AIRFLOW__API_AUTH__JWT_SECRET", "relay-unit-test-secret-" + "x" * 64)

from browser import Chromium, ensure_chromium  # noqa: E402

SECRET = "s3cr3t-db-password"  # in the tracking URI's path: no response may show it
JOB = "seeded"


def payload(field: str) -> str:
    """Return markup that would set the title if it ran, breaking out of either quote."""
    run = f"document.title='pwned {field}'"
    return (f"'\"><img src=x data-pwn={field} onerror=\"{run}\">"
            f"<script>{run}</script><svg data-pwn={field} onload=\"{run}\">")


@dataclass
class Deployment:
    """The page on 127.0.0.1 and what it reads."""

    url: str  # ends with /relay/
    token: str
    tracking_uri: str
    dag_run_id: str


def _seed(tracking_uri: str, artifacts: Path) -> str:
    """Record one faulted DAG run whose every shown field is a payload; return its run id."""
    from relay.lineage.store import (
        TAG_DAG_ID,
        TAG_DAG_RUN,
        TAG_JOB,
        TAG_OUTCOME,
        TAG_PARENT,
        TAG_SEGMENT,
        TAG_TRY,
        Lineage,
    )
    from relay.nodes.pool import NodePool

    lineage = Lineage(tracking_uri, artifacts)
    client, exp = lineage.client, lineage.experiment_id(JOB)
    dag_run_id = payload("dag_run_id")
    parent = client.create_run(exp, run_name="payloads", tags={
        TAG_JOB: JOB, TAG_DAG_ID: payload("dag_id"), TAG_DAG_RUN: dag_run_id,
        TAG_OUTCOME: payload("outcome")}).info.run_id
    for k, v in {"total_steps": "100", "policy_sha256": payload("policy")}.items():
        client.log_param(parent, k, v)
    tries = [("faulted", payload("node_a")), ("faulted", payload("node_c")),
             ("completed", payload("node_b"))]
    for try_number, (outcome, node) in enumerate(tries, start=1):
        child = client.create_run(exp, run_name=f"try-{try_number}", tags={
            TAG_PARENT: parent, TAG_SEGMENT: "0", TAG_TRY: str(try_number), TAG_JOB: JOB,
            TAG_OUTCOME: outcome}).info.run_id
        params = {"nodes": f"{node},node-b", "resume_step": "0", "end_step": "100"}
        for k, v in params.items():
            client.log_param(child, k, v)
        if outcome == "faulted":
            lineage.log_json(child, "decision.json", {
                "fault": {"kind": payload("kind"), "culprit_rank": payload("rank"),
                          "culprit_node": payload("culprit_node"), "detected_at": time.time(),
                          "evidence": _evidence(try_number)},
                "decision": {"action": payload("action"), "rule": payload("rule"),
                             "policy_sha256": payload("decision_sha"),
                             "reason": payload("reason"),
                             "quarantine_node": payload("quarantine_node")},
                "lost_steps": payload("lost_steps"),
                "next_resume_step": payload("next_resume_step")})
    # A tampered record the page cannot read (a segment that is no number): a 500 with its
    # fixed text, where the server's own would skip the policy headers.
    broken = client.create_run(lineage.experiment_id("broken"), tags={
        TAG_JOB: "broken", TAG_DAG_RUN: "manual__broken", TAG_OUTCOME: "faulted"}).info.run_id
    client.create_run(lineage.experiment_id("broken"), tags={
        TAG_PARENT: broken, TAG_SEGMENT: payload("segment"), TAG_TRY: "1", TAG_JOB: "broken",
        TAG_OUTCOME: "completed"})
    node = payload("quarantined")
    NodePool(nodes=[node]).quarantine(node, 3600, payload("quarantine_reason"),
                                      payload("quarantined_by"))
    return dag_run_id


def _evidence(try_number: int) -> dict[str, object]:
    """Return a fault's evidence: a stack as text (try 1) or as ranks' frames (try 2)."""
    evidence: dict[str, object] = {"summary": payload("summary"), "detail": payload("evidence")}
    if try_number == 1:
        return {**evidence, "stack": payload("stack")}
    frames = [f"{payload('frame_file')}:12 in train: {payload('frame_code')}",
              f"/x/.venv/lib/python3.11/site-packages/torch/{payload('torch_file')}:3 in wait",
              payload("frame_raw")]
    return {**evidence, "where": payload("where"), "stacks": [
        {"rank": payload("stack_rank"), "node": payload("stack_node"), "culprit": True,
         "threads": {"main": frames, payload("thread"): frames}},
        {"rank": 0, "culprit": False, "faulthandler": [
            f'  File "{payload("fh_file")}", line 3 in wait', payload("fh_raw")]}]}


def _serve(app: object) -> tuple[str, object, threading.Thread]:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from relay.tools.services import free_port

    port = free_port()
    root = Starlette(routes=[Mount("/relay", app=app)])  # as Airflow's API server mounts it
    server = uvicorn.Server(uvicorn.Config(root, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the page's server did not start"
    return f"http://127.0.0.1:{port}/relay/", server, thread


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory, relay_home: Path) -> Iterator[Deployment]:
    from airflow.api_fastapi.app import get_auth_manager, init_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    from relay.tools.airflow_env import ensure_airflow_db
    from relay.ui.recovery_page import create_app

    home = tmp_path_factory.mktemp("page-home")
    store = home / SECRET
    jobs = home / "jobs"
    jobs.mkdir()
    for job in (JOB, "ghost", "broken"):  # ghost: a job with no MLflow experiment yet
        (jobs / f"{job}.yaml").write_text("{}\n")
    tracking_uri = f"sqlite:///{store / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RELAY_HOME", str(home))
        env.setenv("RELAY_JOBS_DIR", str(jobs))
        env.setenv("RELAY_MLFLOW_TRACKING_URI", tracking_uri)
        env.setenv("RELAY_MLFLOW_ARTIFACT_ROOT", str(store / "artifacts"))
        env.delenv("RELAY_NODE_POOL_URL", raising=False)
        dag_run_id = _seed(tracking_uri, store / "artifacts")
        ensure_airflow_db(dict(os.environ), relay_home / "logs" / "airflow-db.log")
        init_auth_manager()
        token = get_auth_manager().generate_jwt(SimpleAuthManagerUser(username="u", role="VIEWER"))
        url, server, thread = _serve(create_app())
        try:
            yield Deployment(url, token, tracking_uri, dag_run_id)
        finally:
            server.should_exit = True  # type: ignore[attr-defined]
            thread.join(timeout=30)


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    ensure_chromium()
    chromium = Chromium()
    try:
        yield chromium
    finally:
        chromium.close()


def _get(url: str, token: str | None = None, accept: str = "text/html") -> tuple[int, str, dict]:
    headers = {"Accept": accept, **({"Cookie": f"_token={token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), dict(err.headers)


def _nothing_ran(browser: Chromium) -> None:
    title = browser.evaluate("document.title")
    assert not str(title).startswith("pwned"), f"a payload ran: title {title!r}"
    injected = browser.evaluate(
        "Array.from(document.querySelectorAll('[data-pwn], script, svg')).map(e => e.outerHTML)")
    assert injected == [], f"a payload became markup: {injected}"


SHOWN = ("dag_id", "dag_run_id", "policy", "kind", "rank", "culprit_node", "summary", "stack",
         "action", "rule", "reason", "quarantine_node", "node_a", "node_b", "node_c",
         "quarantined", "quarantine_reason", "quarantined_by", "where", "frame_file",
         "frame_code", "torch_file", "frame_raw", "stack_rank", "stack_node", "thread",
         "fh_file", "fh_raw")


def test_payloads_in_the_records_show_as_text_and_never_run(
    page: Deployment, browser: Chromium
) -> None:
    browser.set_cookie(page.url, "_token", page.token)
    try:
        text = browser.open(page.url)
        _nothing_ran(browser)
        assert "Job seeded (DAG relay_seeded)" in text
        listed = browser.evaluate("document.body.textContent")
        assert page.dag_run_id in listed, "the run id shows, as text"
        # The index's own link: the run id's payload went into its URL, where it is refused
        # (no Airflow run id looks like that) with a fixed text.
        href = browser.evaluate(f"document.querySelector('a[href*=relay_{JOB}]').href")
        assert href.startswith(page.url + "run?")
        assert "no record of that DAG run" in browser.open(href)
        _nothing_ran(browser)
        browser.open(page.url + f"run?dag_id=relay_{JOB}")  # the job's newest run
        _nothing_ran(browser)
        shown = browser.evaluate("document.body.textContent")
        missing = [f for f in SHOWN if payload(f) not in shown]
        assert missing == [], f"fields not shown as text: {missing}\n{shown[:3000]}"
        assert json.dumps(payload("evidence"))[1:-1] in shown  # all evidence, as JSON
        assert payload("decision_sha")[:16] in shown  # shown cut to 16 characters
        # Step counts that are not integers read as unknown, not as markup or a crash.
        assert "Lost steps: None; resumes at step None" in shown
        # The page still looks as it did: the nonce'd style block applied, pictures load.
        assert "system-ui" in browser.evaluate("getComputedStyle(document.body).fontFamily")
        assert browser.evaluate("getComputedStyle(document.querySelector('.bar div')).width") \
            not in ("", "auto", "0px") or "step 0 / 100" in shown
        assert all(w > 0 for w in browser.images_loaded()), "the timeline and loss pictures"
    finally:
        browser.clear_cookies()


def test_query_parameters_are_never_echoed(page: Deployment, browser: Chromium) -> None:
    bad = payload("query")
    urls = [
        page.url + "run?" + urlencode({"dag_id": bad}),
        page.url + "run?" + urlencode({"dag_id": "relay_" + bad}),
        page.url + "run?" + urlencode({"dag_id": f"relay_{JOB}", "run_id": bad}),
        page.url + "api/run?" + urlencode({"dag_id": f"relay_{JOB}", "run_id": bad}),
        page.url + "run?" + urlencode({"run_id": bad}),  # no dag_id: 422
        page.url + f"picture/relay_{JOB}/{quote(bad, safe='')}/timeline.png",
        page.url + quote(bad, safe=""),
    ]
    for logged_in in (False, True):
        if logged_in:
            browser.set_cookie(page.url, "_token", page.token)
        try:
            for url in urls:
                browser.open(url, settle=0.2)
                _nothing_ran(browser)
                html = browser.evaluate("document.documentElement.outerHTML")
                assert "pwn" not in html, f"{url} echoed its input: {html[:500]}"
                status, body, _ = _get(url, page.token if logged_in else None)
                assert status >= 400 and "pwn" not in body, (url, status, body[:300])
        finally:
            browser.clear_cookies()


def _every_response(page: Deployment) -> list[tuple[str, int, str, dict]]:
    job = f"relay_{JOB}"
    paths = ["", f"run?dag_id={job}", f"api/run?dag_id={job}", "run?dag_id=relay_ghost",
             "api/run?dag_id=relay_ghost", f"run?dag_id={job}&run_id=never_recorded",
             f"api/run?dag_id={job}&run_id=never_recorded", "run?dag_id=example_bash",
             "run", f"picture/{job}/abc123/timeline.png", "no/such/route",
             "run?dag_id=relay_broken", "api/run?dag_id=relay_broken"]
    found = []
    for path in paths:
        for token in (page.token, None, "not.a.jwt"):
            for accept in ("text/html", "application/json"):
                status, body, headers = _get(page.url + path, token, accept)
                found.append((path, status, body, headers))
    return found


def test_no_response_shows_the_tracking_uri_and_every_one_has_the_policy(
    page: Deployment,
) -> None:
    responses = _every_response(page)
    assert {s for _, s, _, _ in responses} >= {200, 401, 403, 404, 422, 500}
    assert all("failed to read this run" in b for p, s, b, _ in responses if s == 500)
    for path, status, body, headers in responses:
        seen = body + json.dumps(headers)
        assert SECRET not in seen and page.tracking_uri not in seen, (path, status)
        policy = headers.get("content-security-policy", "")
        assert "default-src 'none'" in policy and "script-src" not in policy, (path, policy)
        assert headers.get("x-content-type-options") == "nosniff", path


def _store_state(tracking_uri: str) -> dict[str, object]:
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    state: dict[str, object] = {}
    for exp in client.search_experiments(view_type=ViewType.ALL):
        runs = client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL)
        state[exp.name] = sorted(
            (r.info.run_id, r.info.status, sorted(r.data.tags.items()),
             sorted(r.data.params.items())) for r in runs)
    return state


def test_gets_never_write_to_mlflow(page: Deployment) -> None:
    before = _store_state(page.tracking_uri)
    assert "relay/ghost" not in before
    responses = _every_response(page)
    assert any(p == "" and s == 200 and "Job ghost" in b for p, s, b, _ in responses)
    assert _store_state(page.tracking_uri) == before


def test_a_missing_store_is_not_created_by_a_get(
    page: Deployment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "never" / "mlflow.db"
    monkeypatch.setenv("RELAY_MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    status, body, _ = _get(page.url, page.token)
    assert status == 200 and "No runs recorded yet." in body
    status, body, _ = _get(page.url + f"run?dag_id=relay_{JOB}", page.token)
    assert status == 404 and "no record of that DAG run" in body
    assert not db.parent.exists()
