"""checkpoint_every: auto through `airflow dags test`: each attempt's interval, chosen and kept.

A 2-segment job with `checkpoint_every: {auto: true, ...}` loses a rank in its
first segment. Its first attempt has no record to go by (the stated fallback);
the retry and the next segment pick their interval from what the earlier
attempts logged to MLflow (the async save's stall, the step time, the fault),
record it with every input, and really checkpoint at it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from airflow_jobs import prepare_jobs, run_job_ok

from relay.lineage.interval import FALLBACK_CHECKPOINTS_PER_SEGMENT, INTERVAL_FILE
from relay.lineage.report_files import summary_text
from relay.lineage.run_view import run_view
from relay.lineage.store import TAG_SEGMENT, TAG_TRY, Lineage
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig

pytestmark = pytest.mark.integration

LOW, HIGH, PER_SEGMENT = 3, 30, 30
JOB = f"""\
job: autockpt
seed: 11
total_steps: 60
steps_per_segment: {PER_SEGMENT}
checkpoint_every: {{auto: true, min: {LOW}, max: {HIGH}}}
model: {{context: 32, d_model: 32, n_layers: 1, n_heads: 4, dropout: 0.1}}
data: {{corpus: "builtin:python_docs", batch_size: 8}}
retry_delay: 1s
chaos: allowed
segment_boundary: restart
"""
# restart: every attempt launches, so each picks its own interval and checkpoints exactly
# over [start, end). An adopted segment keeps its workload's interval (tests/unit/
# test_boundary.py), and checkpoints before its adoption belong to the earlier attempt.
CRASH = {"kind": "crash", "segment": 0, "step": 20, "rank": 1, "attempt": 1}


@pytest.mark.slow  # ~60 s: `make test-slow` (CI runs it), keeping `make test` near 10 min
def test_auto_interval_is_chosen_recorded_and_used_per_attempt(
    relay_home: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = tmp_path_factory.mktemp("jobs")
    monkeypatch.setenv("RELAY_JOBS_DIR", str(jobs))  # restored after: later tests load the repo's
    env = prepare_jobs(relay_home, jobs, {"autockpt": JOB})
    parent = run_job_ok(env, relay_home, "autockpt", {"chaos": [CRASH]}, "auto-interval")
    lineage = Lineage.from_settings()
    attempts = {(int(c.data.tags[TAG_SEGMENT]), int(c.data.tags[TAG_TRY])): c
                for c in lineage.child_runs(parent)}
    assert sorted(attempts) == [(0, 1), (0, 2), (1, 1)], sorted(attempts)
    saved: dict[str, set[int]] = {}
    for manifest in lineage.manifests(parent):
        if manifest.origin == "periodic":
            saved.setdefault(manifest.run_id, set()).add(manifest.step)

    choices = {}
    for key, run in attempts.items():
        attempt_dir = Path(run.data.params["attempt_dir"])
        choice = json.loads((attempt_dir / INTERVAL_FILE).read_text())
        launched = LaunchConfig.read(attempt_dir / LAUNCH_FILE)
        every = int(run.data.params["checkpoint_every"])
        # One interval per attempt: the record, the MLflow param and the launch agree.
        assert choice["mode"] == "auto"
        assert choice["steps"] == every == launched.checkpoint_every, key
        assert run.data.params["checkpoint_every_reason"] == choice["reason"]
        assert LOW <= every <= HIGH
        # ... and the ranks checkpointed at it (plus the segment's end).
        start, end = launched.start_step, launched.end_step
        due = {s for s in range(start + 1, end + 1) if s % every == 0 or s == end}
        if key == (0, 1):  # the crash at step 20 ends it early
            due = {s for s in due if s <= CRASH["step"]}
        assert saved.get(run.info.run_id, set()) <= due, (key, every, saved)
        if key != (0, 1):
            assert saved[run.info.run_id] == due, (key, every, saved)
        choices[key] = choice

    first = choices[(0, 1)]  # the job's first attempt: nothing measured yet
    assert first["step_source"] == "not measured yet"
    assert first["steps"] == PER_SEGMENT // FALLBACK_CHECKPOINTS_PER_SEGMENT
    assert first["checkpoint_cost_source"].startswith("default")

    retry = choices[(0, 2)]  # after the crash: the job's own record decides
    assert retry["mtbf_source"].startswith("1 fault(s)"), retry
    assert retry["checkpoint_cost_source"].startswith("median stall of"), retry
    assert retry["step_seconds"] > 0
    young_daly = math.sqrt(2 * retry["checkpoint_cost_seconds"] * retry["mtbf_seconds"])
    assert retry["young_daly_seconds"] == pytest.approx(young_daly, rel=1e-3, abs=1e-3)
    # The nearest whole step to Young/Daly's interval. The record keeps young_daly_seconds
    # to 3 decimals: recomputed from it, a ratio near x.5 may round the other way.
    ratio = retry["young_daly_seconds"] / retry["step_seconds"]
    slack = 0.0005 / retry["step_seconds"] + 1e-9
    unbounded = retry["unbounded_steps"]
    nearest = (unbounded == 1) if ratio < 0.5 - slack else (abs(unbounded - ratio) <= 0.5 + slack)
    assert nearest, (unbounded, ratio)
    assert retry["steps"] == min(max(unbounded, LOW), HIGH)
    assert retry["bound_hit"] == ("min" if unbounded < LOW else "max" if unbounded > HIGH
                                  else None)

    later = choices[(1, 1)]  # the next segment counts both earlier attempts
    assert "of 2 attempt(s)" in later["mtbf_source"], later

    report = summary_text(run_view(lineage, parent))
    assert "checkpoint interval (checkpoint_every: auto)" in report
    assert f"segment 0 try 2: {retry['reason']}" in report
