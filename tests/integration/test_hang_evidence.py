"""A hang's fault in MLflow says where it hung: the culprit's stack and the collective trace.

Through Airflow (`airflow dags test`), real DDP over gloo, real MLflow: rank 1
hangs in the chaos hang loop; before the attempt is stopped, every rank's
stacks and Flight Recorder trace are collected into ``fault.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from airflow_jobs import run_job, use_jobs

from relay.lineage.store import TAG_OUTCOME, Lineage
from relay.ui.stack_view import stacks_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # `make test-slow`

JOB = """\
job: evidence
seed: 5
total_steps: 20
steps_per_segment: 20
checkpoint_every: 10
nodes: 2
ranks_per_node: 2
model: {context: 32, d_model: 32, n_layers: 1, n_heads: 4, dropout: 0.1}
data: {corpus: "builtin:python_docs", batch_size: 8}
retries: 2
retry_delay: 1s
chaos: allowed
"""
# Whichever attempt first reaches step 12: on a loaded machine an earlier attempt may end
# in a false alarm (a straggler) before it gets there.
HANG = {"kind": "hang", "segment": 0, "step": 12, "rank": 1, "attempt": None, "once": True}


@pytest.fixture(scope="module")
def env(relay_home: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    jobs = tmp_path_factory.mktemp("evidence-jobs")
    (jobs / "evidence.yaml").write_text(JOB)
    return use_jobs(relay_home, jobs)


def test_the_hang_fault_carries_the_culprits_stack_and_the_collective_trace(
    env: dict[str, str], relay_home: Path, tmp_path: Path
) -> None:
    code, parent = run_job(env, relay_home, "evidence", {"chaos": [HANG]}, "hang-evidence")
    log = (relay_home / "logs" / "hang-evidence.log").read_text()
    assert code == 0, f"airflow dags test failed:\n{log[-4000:]}"
    lineage = Lineage.from_settings()
    children = lineage.child_runs(parent)
    faulty = [c for c in children if c.data.tags[TAG_OUTCOME] == "faulted"
              and c.data.tags["relay.fault_kind"] == "hang"]
    assert len(faulty) == 1, [c.data.tags for c in children]
    run_id = faulty[0].info.run_id
    fault = json.loads(Path(lineage.client.download_artifacts(
        run_id, "fault.json", str(tmp_path))).read_text())
    assert (fault["kind"], fault["culprit_rank"]) == ("hang", 1)
    evidence = fault["evidence"]
    assert evidence["stacks_missing_ranks"] == []
    # The phases' culprit, confirmed by its stack before the decision (relay.recover.culprit).
    check = evidence["culprit_check"]
    assert (check["heartbeat_culprit"], check["culprit"]) == (1, 1), check
    assert check["note"].startswith("rank 1 confirmed by its stack: in chaos_hang_forever")

    # The culprit's stack comes first and ends in the chaos hang loop.
    culprit = evidence["stacks"][0]
    assert (culprit["rank"], culprit["culprit"]) == (1, True)
    assert "chaos_hang_forever" in culprit["threads"]["main"][-1]
    assert evidence["where"].startswith("rank 1 in chaos_hang_forever")
    # The Recovery page reads it innermost first: the user's loop (the built-in example's
    # `for step in session.steps()`) shown, the chaos loop in Relay's code folded.
    threads, as_text = stacks_of(evidence["stacks"])
    assert as_text is None and threads[0].culprit
    assert threads[0].shown[0].file.endswith("examples/charlm.py"), threads[0].shown
    assert threads[0].folded[0].function == "chaos_hang_forever"
    assert sorted(s["rank"] for s in evidence["stacks"]) == [0, 1, 2, 3]

    # The others wait in the step's collective; the Flight Recorder says which one.
    for rank in ("0", "2", "3"):
        groups = evidence["collectives"][rank]
        last = [entry for entries in groups.values() for entry in entries][-1]
        assert last["op"] == "gloo:all_gather" and not last["finished"], groups
        assert f"rank {rank} waits in gloo:all_gather" in evidence["where"]
    assert all(e["finished"] for g in evidence["collectives"]["1"].values() for e in g)

    # The raw files are in the run too, for the stacks of every thread and torch's analyzer.
    listed = {a.path for a in lineage.client.list_artifacts(run_id, "evidence")}
    assert {"evidence/rank-1.json", "evidence/fr-rank-0.json", "evidence/fr"} <= listed
    assert "where it stopped: rank 1 in chaos_hang_forever" in log
