"""execute_complete on "another machine": the attempt is found through what travelled with it.

Real Airflow (`airflow dags test`, its task state store in its metadata database),
a real MLflow store on disk, real node agents and gloo ranks (local launcher).

Simulated: the machine boundary. With Airflow's Celery or Kubernetes executor,
``execute_complete`` may run on a worker that never saw the folder ``execute``
wrote, and a retry on a worker that never saw the earlier tries' folders. Here
every ``execute_complete`` stops at the test pause point ``complete``
(:mod:`relay.core.testhooks`, on only with ``RELAY_TEST_PAUSE_DIR``), and the test
deletes what Relay's side wrote into the attempt folder at launch
(``launch.json``, ``handle.json``, ``task.json``, ``checkpoint_interval.json``;
the ranks read their copy of ``launch.json`` when they started), and, before
the second fault is handled, the first try's whole folder with its
``decision.json``. The decisions, the quarantine and the retries must still
come out right: from the launch record in the watcher's event and the fault
history in the task state store.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from airflow_jobs import prepare_jobs

from relay.core.testhooks import ENV as PAUSE_ENV
from relay.launchers.local.launcher import HANDLE_FILE
from relay.lineage.interval import INTERVAL_FILE
from relay.lineage.resume_time import TASK_FILE
from relay.lineage.store import TAG_DAG_ID, TAG_OUTCOME, TAG_SEGMENT, TAG_TRY, Lineage
from relay.tools.demo import run_dag_test
from relay_train.protocol.launch import LAUNCH_FILE

pytestmark = pytest.mark.integration

JOB = """\
job: elsewhere
seed: 11
total_steps: 30
steps_per_segment: 30
checkpoint_every: 10
nodes: 2
ranks_per_node: 2
model: {context: 32, d_model: 32, n_layers: 1, n_heads: 4, dropout: 0.1}
data: {corpus: "builtin:python_docs", batch_size: 8}
retries: 3
retry_delay: 1s
chaos: allowed
"""
HANGS = [  # rank 2 is on try 1's second node; rank 1 on try 2's first
    {"kind": "hang", "segment": 0, "step": 15, "rank": 2, "attempt": 1},
    {"kind": "hang", "segment": 0, "step": 25, "rank": 1, "attempt": 2},
]
LAUNCH_ONLY = (LAUNCH_FILE, HANDLE_FILE, TASK_FILE, INTERVAL_FILE)  # what execute wrote
PAUSE_WAIT_SECONDS = 300.0


def _paused(pause_dir: Path, proc: Any) -> Path | None:  # noqa: ANN401 - Popen
    """Wait until an execute_complete waits at the pause point; return its attempt folder."""
    paused = pause_dir / "complete.paused"
    deadline = time.monotonic() + PAUSE_WAIT_SECONDS
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return Path(json.loads(paused.read_text())["attempt_dir"])
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
    return None


def _forget(attempt: Path, also: list[Path]) -> list[str]:
    """Delete what only Relay's side wrote at launch (and whole earlier tries); say what."""
    gone = []
    for name in LAUNCH_ONLY:
        if (attempt / name).exists():
            (attempt / name).unlink()
            gone.append(f"{attempt.name}/{name}")
    for folder in also:
        shutil.rmtree(folder)
        gone.append(f"{folder.name}/")
    return gone


def _decision(lineage: Lineage, run: Any, where: Path) -> dict[str, Any]:  # noqa: ANN401
    path = lineage.client.download_artifacts(run.info.run_id, "decision.json",
                                             str(where / run.info.run_id))
    return json.loads(Path(path).read_text())


@pytest.mark.slow  # ~60 s: `make test-slow` (CI runs it), keeping `make test` near 10 min
def test_execute_complete_without_the_folder_execute_wrote_decides_quarantines_and_retries(
    relay_home: Path, tmp_path: Path
) -> None:
    (tmp_path / "jobs").mkdir()
    env = prepare_jobs(relay_home, tmp_path / "jobs", {"elsewhere": JOB})
    pause_dir = tmp_path / "pause"
    pause_dir.mkdir()
    log_file = relay_home / "logs" / "elsewhere.log"
    proc = run_dag_test("relay_elsewhere", {"chaos": HANGS},
                        {**env, PAUSE_ENV: str(pause_dir)}, log_file)
    forgotten: list[list[str]] = []
    try:
        for _fault in HANGS:
            (pause_dir / "complete.request").write_text("")
            attempt = _paused(pause_dir, proc)
            if attempt is None:
                break
            earlier = [p for p in attempt.parent.glob("try-*") if p != attempt]
            forgotten.append(_forget(attempt, earlier))
            (pause_dir / "complete.paused").unlink()
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_file.read_text()
    assert [sorted(f) for f in forgotten] == [
        sorted(f"try-1/{n}" for n in LAUNCH_ONLY),
        sorted([*(f"try-2/{n}" for n in LAUNCH_ONLY), "try-1/"]),
    ], f"the simulation did not happen as planned: {forgotten}\n{log[-3000:]}"
    assert code == 0, f"airflow dags test failed; see {log_file}:\n{log[-4000:]}"

    lineage = Lineage.from_settings()
    parent = lineage.client.search_runs(
        [lineage.experiment_id("elsewhere")],
        filter_string=f"tags.`{TAG_DAG_ID}` = 'relay_elsewhere'",
        order_by=["attributes.start_time DESC"], max_results=1)[0].info.run_id
    runs = {int(c.data.tags[TAG_TRY]): c for c in lineage.child_runs(parent)
            if c.data.tags[TAG_SEGMENT] == "0"}
    assert {t: r.data.tags[TAG_OUTCOME] for t, r in runs.items()} == {
        1: "faulted", 2: "faulted", 3: "completed"}
    first, second = (_decision(lineage, runs[t], tmp_path / "mlflow") for t in (1, 2))

    # Try 1: the hang found through the launch record alone; the stalled rank's node
    # quarantined; the healthy ranks' state rescued (over the channel, at the recorded ports).
    assert (first["fault"]["kind"], first["fault"]["culprit_rank"]) == ("hang", 2)
    assert first["decision"]["action"] == "restart_elsewhere"
    culprit = first["decision"]["quarantine_node"]
    assert culprit == runs[1].data.params["nodes"].split(",")[1]
    assert first["rescued"] is not None and first["lost_steps"] == 0, first
    assert culprit not in runs[2].data.params["nodes"].split(",")
    # Try 2: try 1's folder (its decision.json) is gone, yet this is the 2nd hang: the
    # history came from the task state store.
    assert second["fault"]["kind"] == "hang"
    assert second["decision"]["reason"].startswith("the 2nd hang in this segment"), second
    assert second["decision"]["quarantine_node"] == runs[2].data.params["nodes"].split(",")[0]
    assert not {culprit, second["decision"]["quarantine_node"]} & set(
        runs[3].data.params["nodes"].split(","))
    assert [m.step for m in lineage.chain(parent)][0] == 30
    assert "No launch record of" not in log, "a launch file was read instead of the record"
