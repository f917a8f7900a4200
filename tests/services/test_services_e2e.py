"""Relay in a running Airflow: `make up`'s own script, the REST API, the Recovery page.

Real processes throughout: Airflow's API server, scheduler, DAG processor and
triggerer (LocalExecutor), an MLflow tracking server, 4-rank DDP over gloo, and
Debian's headless Chromium. Slow (several minutes): `make test-services`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest
from airflow_runs import DAG_ID, run_to_end, wait_for_success, wait_for_task_state
from browser import Chromium, ensure_chromium
from mlflow.entities import LoggedModelStatus

from relay.core.airflow_api import AirflowApi
from relay.core.settings import REPO_ROOT
from relay.lineage.links import experiment_url
from relay.lineage.models import checkpoint_key, checkpoint_models, model_name
from relay.lineage.report import final_state, same_bits
from relay.lineage.run_view import RunView, find_parent, run_view
from relay.lineage.store import TAG_EXPERIMENT_KIND, TAG_FAULT, Lineage
from relay.tools import services

pytestmark = pytest.mark.services

HANG = {"kind": "hang", "segment": 0, "step": 35, "rank": 1}
# Segment 1's steps slower (every rank alike: no fault, same weights), so that its task
# stays deferred for 12 s more: a test that acts while it is deferred cannot miss it.
SLOW_SEGMENT_1 = {"kind": "pace", "segment": 1, "step": 60, "seconds": 0.2}
# Pictures of each view for docs/ (docs/operations.md shows them); the tests write them there
# only when asked (RELAY_UPDATE_SCREENSHOT=1), so a test run leaves the clone as it was.
SCREENSHOTS = REPO_ROOT / "docs" / "screenshots"
GENAI_ONLY = ("Evaluation runs", "Judges", "Agent versions")  # MLflow's GenAI sidebar


def _picture(browser: Chromium, name: str, tmp_path: Path) -> None:
    """Screenshot the page: into docs/screenshots when asked, else beside the test."""
    folder = SCREENSHOTS if os.environ.get("RELAY_UPDATE_SCREENSHOT") == "1" else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    assert browser.screenshot(folder / name).stat().st_size > 0


@pytest.fixture(scope="module")
def faulty_run(api: AirflowApi, clean_run: str) -> str:
    return run_to_end(api, {"chaos": [HANG]})


def _view(run_id: str) -> RunView:
    lineage = Lineage.from_settings()
    return run_view(lineage, find_parent(lineage, "demo", run_id))


def test_a_stalled_rank_is_retried_elsewhere_and_ends_bit_exact(
        api: AirflowApi, clean_run: str, faulty_run: str, tmp_path: Path) -> None:
    tries = {t["task_id"]: t["try_number"] for t in api.task_instances(DAG_ID, faulty_run)}
    assert tries["segment_000"] == 2, f"segment_000 should have been retried once: {tries}"
    view = _view(faulty_run)
    seg0 = [a for a in view.attempts if a.segment == 0]
    faulty = next(a for a in seg0 if a.fault)
    retry = next(a for a in seg0 if a.outcome == "completed")
    assert faulty.fault["kind"] == "hang" and faulty.fault["culprit_rank"] == 1
    culprit_node = faulty.fault["culprit_node"]
    assert culprit_node in faulty.nodes and culprit_node not in retry.nodes
    assert view.outcome == "completed" and view.progress_step == view.total_steps
    lineage = Lineage.from_settings()
    clean = final_state(lineage, find_parent(lineage, "demo", clean_run), tmp_path / "clean")
    recovered = final_state(lineage, view.parent_run_id, tmp_path / "faulty")
    assert clean is not None and recovered is not None
    same, detail = same_bits(clean, recovered)
    assert same, detail
    # The pictures went to the DAG run's MLflow run; the experiment opens in the training view.
    logged = {a.path for a in lineage.client.list_artifacts(view.parent_run_id, "report")}
    assert logged == {"report/timeline.png", "report/loss.png", "report/throughput.png"}, logged
    exp = lineage.client.get_experiment(lineage.experiment_id("demo"))
    assert exp.tags.get(TAG_EXPERIMENT_KIND) == "custom_model_development"
    # The faulty attempt logged its loss up to the fault, not only up to its last checkpoint.
    losses = lineage.client.get_metric_history(faulty.run_id, "loss")
    assert max(m.step for m in losses) >= HANG["step"] - 5
    # Airflow tells the story: Relay's notes on the DAG run and on the retried task only.
    note = api.dag_run(DAG_ID, faulty_run)["note"]
    assert note is not None and note.startswith("Relay: 1 fault (hang); "), note
    notes = {t["task_id"]: t["note"] for t in api.task_instances(DAG_ID, faulty_run)}
    assert notes["segment_000"].startswith(f"Recovered: hang of rank 1 on {culprit_node} "), notes
    assert f"restarted on {', '.join(retry.nodes)} from step" in notes["segment_000"], notes
    # Rewritten once the retry reached its segment's end (completed or handed over).
    assert ", back in " in notes["segment_000"] and "not resumed yet" not in note, (note, notes)
    assert notes["segment_001"] is None and api.dag_run(DAG_ID, clean_run)["note"] is None


def test_recovery_page_in_chromium(deployment: services.Deployment, api: AirflowApi,
                                   faulty_run: str, tmp_path: Path) -> None:
    view = _view(faulty_run)
    fault = next(a.fault for a in view.attempts if a.fault)
    url = f"{deployment.api_url}/relay/run?" + urlencode({"dag_id": DAG_ID, "run_id": faulty_run})
    ensure_chromium()
    browser = Chromium()
    try:
        refused = browser.open(url, settle=0)
        assert "401" in refused and "Log in" in refused
        assert "hang" not in refused
        # Airflow's UI keeps its login as the `_token` cookie; the token comes from
        # the same login API the UI's form posts to.
        browser.set_cookie(deployment.api_url, "_token", api.token())
        # The index: the faulty run's row stands out and counts its fault.
        browser.resize(1280, 800)
        browser.open(f"{deployment.api_url}/relay/", settle=0)
        row = browser.evaluate(
            "Array.from(document.querySelectorAll('tr')).filter(r => r.innerText.includes("
            f"{faulty_run!r})).map(r => [r.className, r.innerText])[0] || null")
        assert row is not None and row[0] == "faulted" and "1 fault" in row[1], row
        _picture(browser, "recovery-index.png", tmp_path)
        browser.resize(1280, 2400)  # the whole page
        text = browser.open(url, settle=0)
        assert "hang" in text
        assert f"culprit rank 1, node {fault['culprit_node']}" in text
        assert "restart_elsewhere" in text and "rules.hang" in text
        assert view.policy_sha256 in text
        # Where it stopped, above the stack; the stack starts with the culprit's own frame
        # (the demo's loop, relay_train.examples.charlm), Relay's and Python's folded.
        assert "Where it stopped: rank 1 in " in text
        first = browser.evaluate("document.querySelector('.stack ol.frames li').innerText")
        assert "examples/charlm.py:" in first and "(Relay)" not in first, first
        assert browser.evaluate("document.querySelector('.stack details.folded').open") is False
        assert "Goodput so far" not in text and "ETA" not in text.split("Goodput")[0]
        widths = browser.images_loaded()
        assert len(widths) == 3 and all(w > 0 for w in widths), widths
        _picture(browser, "recovery-page.png", tmp_path)
        browser.clear_cookies()
        assert "401" in browser.open(url, settle=0)
    finally:
        browser.close()


def test_airflow_ui_shows_relays_notes_in_chromium(
        deployment: services.Deployment, api: AirflowApi, faulty_run: str,
        tmp_path: Path) -> None:
    """Airflow 3's own (React) UI shows Relay's notes on the run's page and the retried task's."""
    run_note = api.dag_run(DAG_ID, faulty_run)["note"]
    task_note = {t["task_id"]: t["note"] for t in api.task_instances(DAG_ID, faulty_run)}[
        "segment_000"]
    assert run_note and task_note, (run_note, task_note)
    run_page = f"{deployment.api_url}/dags/{DAG_ID}/runs/{quote(faulty_run, safe='')}"
    ensure_chromium()
    browser = Chromium()
    try:
        browser.resize(1280, 800)
        browser.set_cookie(deployment.api_url, "_token", api.token())
        for url, note, name in ((run_page, run_note, "airflow-run-note.png"),
                                (f"{run_page}/tasks/segment_000", task_note,
                                 "airflow-task-note.png")):
            browser.open(url, settle=0)
            # The note's first line: the run's page shows it, the rest behind "…".
            head = note.splitlines()[0]
            text = browser.wait_for_text(lambda t, head=head: head in t)
            assert head in text, f"{url} does not show {head!r}:\n{text[:2000]}"
            assert "Add a note" not in text, text[:2000]
            _picture(browser, name, tmp_path)
    finally:
        browser.close()


def test_mlflow_opens_the_training_view_and_lists_the_checkpoints(
        deployment: services.Deployment, faulty_run: str, tmp_path: Path) -> None:
    """A fresh browser (its own empty profile) following Relay's link to the experiment lands
    on MLflow's model-training view, and the Models tab lists the faulty run's chain."""
    lineage = Lineage.from_settings()
    experiment = lineage.experiment_id("demo")
    parent = find_parent(lineage, "demo", faulty_run)
    chain = lineage.chain(parent)
    assert chain, "the faulty run published no checkpoint"
    # Each checkpoint of the run is a READY model (the clean run's bear the same names: the
    # browser below sees the names, this sees they are this run's).
    models = checkpoint_models(lineage, experiment)
    assert all(models[checkpoint_key(m)].status == LoggedModelStatus.READY for m in chain)
    names = [model_name(m) for m in chain]
    ensure_chromium()
    for tab, wanted, name in (("", [parent_name(lineage, parent)], "mlflow-runs.png"),
                              ("models", names, "mlflow-models.png")):
        browser = Chromium()  # a new --user-data-dir each time: nothing remembered
        try:
            browser.resize(1280, 800)
            browser.open(experiment_url(deployment.mlflow_url, experiment, tab), settle=0)
            text = browser.wait_for_text(lambda t, w=wanted: all(n in t for n in w))
            missing = [n for n in wanted if n not in text]
            assert not missing, f"{tab or 'experiment'} does not list {missing}:\n{text[:2000]}"
            assert not [w for w in GENAI_ONLY if w in text], text[:2000]
            assert "workflowType=machine_learning" in str(browser.evaluate("location.href"))
            _picture(browser, name, tmp_path)
        finally:
            browser.close()


def parent_name(lineage: Lineage, parent: str) -> str:
    """Return the name the runs table shows for a DAG run's MLflow run."""
    return str(lineage.client.get_run(parent).info.run_name)


def _assert_same_weights(clean_run: str, run_id: str, where: Path) -> None:
    lineage = Lineage.from_settings()
    clean = final_state(lineage, find_parent(lineage, "demo", clean_run), where / "clean")
    survived = final_state(lineage, find_parent(lineage, "demo", run_id), where / "survived")
    assert clean is not None and survived is not None
    same, detail = same_bits(clean, survived)
    assert same, detail


def _faults(view: RunView) -> str:
    """Say what each attempt ended in, and any fault's kind (its run's tag, should its
    decision.json not be read) and evidence (for a failure)."""
    client = Lineage.from_settings().client
    return "\n".join(
        f"segment {a.segment} try {a.try_number}: {a.outcome}"
        + (f" {client.get_run(a.run_id).data.tags.get(TAG_FAULT)} {a.fault}"
           if a.outcome == "faulted" else "") for a in view.attempts)


def _crash(deployment: services.Deployment, name: str) -> None:
    """SIGKILL a component's main process only, as a crash would (its children live on)."""
    os.kill(services.read_deployment(Path(deployment.home)).pids[name], signal.SIGKILL)


def test_triggerer_and_scheduler_crashes_do_not_stop_the_run(
        deployment: services.Deployment, api: AirflowApi, clean_run: str,
        tmp_path: Path) -> None:
    home = Path(deployment.home)
    run_id = api.trigger(DAG_ID, {"chaos": [SLOW_SEGMENT_1]})
    # The triggerer dies while segment 0 is deferred to it, and comes back 5 s later.
    wait_for_task_state(api, run_id, "segment_000", {"deferred"})
    _crash(deployment, "triggerer")
    time.sleep(5)
    services.restart("triggerer", home)
    # The scheduler dies while segment 1 runs, and comes back 5 s later.
    wait_for_task_state(api, run_id, "segment_001", {"deferred", "running"})
    _crash(deployment, "scheduler")
    time.sleep(5)
    services.restart("scheduler", home)
    wait_for_success(api, run_id)
    view = _view(run_id)
    # One workload per segment: no attempt faulted, none was started twice beside another.
    assert [(a.segment, a.outcome) for a in view.attempts if a.outcome != "abandoned"] == [
        (s, "completed") for s in range(4)], _faults(view)
    assert not [a for a in view.attempts if a.fault], (
        f"a crash of Airflow is not a training fault:\n{_faults(view)}")
    _assert_same_weights(clean_run, run_id, tmp_path)


def test_mlflow_server_down_for_30s_mid_segment(
        deployment: services.Deployment, api: AirflowApi, clean_run: str,
        tmp_path: Path) -> None:
    home = Path(deployment.home)
    run_id = api.trigger(DAG_ID, {"chaos": [SLOW_SEGMENT_1]})
    wait_for_task_state(api, run_id, "segment_001", {"deferred"})
    pid = services.read_deployment(home).pids["mlflow"]
    os.killpg(pid, signal.SIGKILL)  # the whole server, workers included
    time.sleep(30)
    services.restart("mlflow", home)
    wait_for_success(api, run_id)
    lineage = Lineage.from_settings()
    parent = find_parent(lineage, "demo", run_id)
    # Every checkpoint made while the server was down was published once it was back.
    steps = sorted(m.step for m in lineage.chain(parent))
    assert steps == list(range(20, 241, 20)), steps
    _assert_same_weights(clean_run, run_id, tmp_path)
