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
from urllib.parse import urlencode

import pytest
from airflow_runs import DAG_ID, run_to_end, wait_for_success, wait_for_task_state
from browser import Chromium

from relay.core.settings import REPO_ROOT
from relay.lineage.report import final_state, same_bits
from relay.lineage.run_view import RunView, find_parent, run_view
from relay.lineage.store import TAG_EXPERIMENT_KIND, TAG_FAULT, Lineage
from relay.tools import services
from relay.tools.airflow_api import AirflowApi

pytestmark = pytest.mark.services

HANG = {"kind": "hang", "segment": 0, "step": 35, "rank": 1}
# Segment 1's steps slower (every rank alike: no fault, same weights), so that its task
# stays deferred for 12 s more: a test that acts while it is deferred cannot miss it.
SLOW_SEGMENT_1 = {"kind": "pace", "segment": 1, "step": 60, "seconds": 0.2}
# The README's picture; the test writes it only when asked (RELAY_UPDATE_SCREENSHOT=1), so
# a test run leaves the clone as it was.
SCREENSHOT = REPO_ROOT / "docs" / "recovery-page.png"


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
    assert notes["segment_001"] is None and api.dag_run(DAG_ID, clean_run)["note"] is None


def test_recovery_page_in_chromium(deployment: services.Deployment, api: AirflowApi,
                                   faulty_run: str, tmp_path: Path) -> None:
    view = _view(faulty_run)
    fault = next(a.fault for a in view.attempts if a.fault)
    url = f"{deployment.api_url}/relay/run?" + urlencode({"dag_id": DAG_ID, "run_id": faulty_run})
    browser = Chromium()
    try:
        refused = browser.open(url)
        assert "401" in refused and "Log in" in refused
        assert "hang" not in refused
        # Airflow's UI keeps its login as the `_token` cookie; the token comes from
        # the same login API the UI's form posts to.
        browser.set_cookie(deployment.api_url, "_token", api.token())
        text = browser.open(url)
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
        picture = SCREENSHOT if os.environ.get("RELAY_UPDATE_SCREENSHOT") == "1" else (
            tmp_path / SCREENSHOT.name)
        browser.screenshot(picture)
        assert picture.stat().st_size > 0
        browser.clear_cookies()
        assert "401" in browser.open(url)
    finally:
        browser.close()


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
