"""Faults of the deployment itself while a training fault is being handled, with real services.

- The scheduler is down when the triggerer detects a stalled rank: the warden stops the
  hung workload within the policy's bound (after the rescue), while the scheduler is still
  down; once it is back, the run succeeds from the rescued state.
- The task process is SIGKILLed while ``execute_complete`` stops and records a fault: the
  retry finds the attempt in the task state store, finishes its record once, never runs
  its own workload beside the old one, and the run succeeds with nothing lost.

Real processes throughout (`make up`'s services, 4-rank DDP over gloo). `make test-services`.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from airflow_runs import DAG_ID, wait_for_success, wait_for_task_state
from processes import workload_processes

from relay.core import testhooks
from relay.core.airflow_api import AirflowApi
from relay.core.paths import safe_name
from relay.core.proctree import alive
from relay.core.settings import REPO_ROOT
from relay.launchers.local.launcher import group_members
from relay.lineage.report import final_state, same_bits
from relay.lineage.run_view import find_parent, run_view
from relay.lineage.store import Lineage
from relay.nodes.pool import NodePool
from relay.policy.model import UNATTENDED_MARGIN_SECONDS, load_policy
from relay.recover.claim import claimed_by
from relay.recover.warden_record import STOPPED_FILE, Stopped, folder
from relay.tools import services

pytestmark = pytest.mark.services

HANG = {"kind": "hang", "segment": 0, "step": 35, "rank": 1}
DETECTION = load_policy(REPO_ROOT / "policies" / "default.yaml").policy.detection


def _attempt(home: Path, run_id: str, segment: int, attempt: int) -> Path:
    return home / "runs" / DAG_ID / safe_name(run_id) / f"segment-{segment:03d}" / f"try-{attempt}"


def _wait_for(path: Path, timeout: float) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)
    return path


def _processes_of(home: Path, attempt: Path) -> list[int]:
    """Return the attempt's agents and ranks (not its warden): the members of the process
    groups its launcher recorded. Not by command line: an agent may be a standby started
    for the attempt, or forked from the previous attempt's agent, so it need not name it."""
    try:
        nodes = json.loads((attempt / "handle.json").read_text())["nodes"]
    except (OSError, ValueError, KeyError):
        return []
    return sorted(p for ids in nodes.values() for p in group_members(int(ids["pgid"])))


def _pool(home: Path) -> NodePool:
    return NodePool(state_file=home / "nodes.json")


@pytest.fixture(autouse=True)
def release_quarantines(deployment: services.Deployment) -> Iterator[None]:
    """Each test's culprit node goes back in the pool: 5 nodes would not last 4 faults."""
    yield
    pool = _pool(Path(deployment.home))
    for node in pool.quarantines():
        pool.release(node)


def _check_recovered(clean_run: str, run_id: str, attempt: Path, where: Path) -> dict:
    """The fault is recorded once, resumed from the rescued state, bit-exact; return the record."""
    record = json.loads((attempt / "decision.json").read_text())
    assert record["fault"]["kind"] == "hang" and record["fault"]["culprit_rank"] == 1
    assert record["rescued"] is not None, record
    assert record["next_resume_step"] == record["rescued"]["step"] and record["lost_steps"] == 0
    lineage = Lineage.from_settings()
    parent = find_parent(lineage, "demo", run_id)
    view = run_view(lineage, parent)
    seg0 = [(a.try_number, a.outcome, (a.fault or {}).get("kind")) for a in view.attempts
            if a.segment == 0]
    assert seg0 == [(1, "faulted", "hang"), (2, "completed", None)], seg0
    # The rescued state is in the chain the final weights came from: no step was lost.
    assert record["rescued"]["step"] in [m.step for m in lineage.chain(parent)]
    clean = final_state(lineage, find_parent(lineage, "demo", clean_run), where / "clean")
    survived = final_state(lineage, parent, where / "survived")
    assert clean is not None and survived is not None
    same, detail = same_bits(clean, survived)
    assert same, detail
    return record


def test_scheduler_down_while_a_fault_is_detected(
        deployment: services.Deployment, api: AirflowApi, clean_run: str,
        tmp_path: Path) -> None:
    home = Path(deployment.home)
    run_id = api.trigger(DAG_ID, {"chaos": [HANG]})
    wait_for_task_state(api, run_id, "segment_000", {"deferred"})
    scheduler = services.read_deployment(home).pids["scheduler"]
    os.kill(scheduler, signal.SIGKILL)  # a crash: its log server and workers live on
    try:
        stopped = _stopped_while_scheduler_down(api, home, run_id, scheduler)
    finally:  # whatever happened, the next tests need a scheduler
        services.restart("scheduler", home)
    wait_for_success(api, run_id)
    attempt = _attempt(home, run_id, 0, 1)
    record = _check_recovered(clean_run, run_id, attempt, tmp_path)
    assert record["rescued"]["step"] == stopped.rescued["step"]
    assert not workload_processes(home), "a workload or a warden outlived the run"


def _stopped_while_scheduler_down(api: AirflowApi, home: Path, run_id: str,
                                  scheduler: int) -> Stopped:
    """Wait for the warden's stop; check it came within the bound, the scheduler still down."""
    attempt = _attempt(home, run_id, 0, 1)
    bound = (DETECTION.stop_unattended_after + DETECTION.checkpoint_timeout
             + UNATTENDED_MARGIN_SECONDS)
    _wait_for(folder(attempt) / STOPPED_FILE, bound + 120)
    stopped = Stopped.read(attempt)
    assert stopped is not None
    # Stopped by the warden, within the bound, while the scheduler was still down.
    assert not alive(scheduler)
    assert claimed_by(attempt)["by"] == "warden"
    assert DETECTION.stop_unattended_after <= stopped.stopped_at - stopped.detected_at <= bound
    assert not _processes_of(home, attempt), "the hung workload outlived its warden"
    assert stopped.rescued is not None and stopped.survivors == []
    tis = {t["task_id"]: t["state"] for t in api.task_instances(DAG_ID, run_id)}
    assert tis["segment_000"] == "scheduled", tis  # nobody ran execute_complete meanwhile
    print(f"\nworkload stopped {stopped.stopped_at - stopped.detected_at:.1f}s after the "
          f"fault was detected (bound {bound:g}s)")
    return stopped


@pytest.mark.parametrize("point", ["stop", "record"])
def test_task_killed_while_recording_a_fault(
        deployment: services.Deployment, api: AirflowApi, clean_run: str, tmp_path: Path,
        point: str) -> None:
    pauses = Path(os.environ[testhooks.ENV])
    (pauses / f"{point}.request").write_text("")
    try:
        _kill_mid_record(api, Path(deployment.home), clean_run, tmp_path, pauses, point)
    finally:  # never leave a pause behind for a later test's task
        for name in (f"{point}.request", f"{point}.paused"):
            (pauses / name).unlink(missing_ok=True)


def _kill_mid_record(api: AirflowApi, home: Path, clean_run: str, tmp_path: Path,
                     pauses: Path, point: str) -> None:
    run_id = api.trigger(DAG_ID, {"chaos": [HANG]})
    paused = _wait_for(pauses / f"{point}.paused", 600)
    info = json.loads(paused.read_text())
    attempt = Path(info["attempt_dir"])
    assert attempt == _attempt(home, run_id, 0, 1)
    alive_at_kill = _processes_of(home, attempt)
    # "stop": before the workload is stopped; "record": stopped, nothing recorded yet.
    assert bool(alive_at_kill) is (point == "stop"), alive_at_kill
    assert not (attempt / "decision.json").exists()
    os.kill(int(info["pid"]), signal.SIGKILL)  # the task process, mid-record
    paused.unlink()
    # When the retry's workload starts, the old one must be gone: never both at once.
    retry = _attempt(home, run_id, 0, 2)
    _wait_for(retry / "handle.json", 600)
    assert not _processes_of(home, attempt), "the retry started beside a live workload"
    wait_for_success(api, run_id)
    tries = {t["task_id"]: t["try_number"] for t in api.task_instances(DAG_ID, run_id)}
    assert tries["segment_000"] == 2, tries
    _check_recovered(clean_run, run_id, attempt, tmp_path)
    # The retry finished the record once: its log says so once, the culprit's node is
    # quarantined by this run.
    logs = [p for p in (home / "airflow" / "logs").rglob("attempt=2.log")
            if f"run_id={run_id}" in str(p) and "task_id=segment_000" in str(p)]
    text = "".join(p.read_text() for p in logs)
    assert text.count("The previous try died while stopping and recording") == 1, logs
    record = json.loads((attempt / "decision.json").read_text())
    assert record["decision"]["quarantine_node"] in _pool(home).quarantines()
    assert not workload_processes(home), "a workload or a warden outlived the run"
