"""Fencing in the lineage: once Relay stops or replaces an attempt, its later checkpoints
do not count (real MLflow store on disk, real checkpoint files)."""

from __future__ import annotations

import time
from pathlib import Path

from published import publish_checkpoint as _publish

from relay.lineage.store import TAG_FENCED_AT, TAG_FENCED_CHECKPOINTS, TAG_REJECTED, Lineage


def test_a_checkpoint_published_after_the_fence_is_refused_and_recorded(tmp_path: Path) -> None:
    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    parent = lineage.parent_run("t", "relay_t", "run-1")
    old = lineage.attempt_run(parent, 0, 1, {"segment": 0})
    _publish(lineage, old, 20, tmp_path)

    accepted = lineage.fence_attempt(old, "replaced after node_unresponsive (try 1)")
    assert accepted == ["step-00000020"]
    _publish(lineage, old, 40, tmp_path)  # the partitioned node comes back and publishes

    latest, corrupt = lineage.resume_point(parent, tmp_path / "download")
    assert corrupt == [] and latest is not None and latest.manifest.step == 20
    tags = lineage.client.get_run(old).data.tags
    assert float(tags[TAG_FENCED_AT]) <= time.time()
    assert tags[TAG_REJECTED + "step-00000040"].startswith(
        f"fenced: published by attempt run {old} after Relay stopped or replaced it")
    assert [m.step for m in lineage.manifests(parent)] == [20]  # refused for good, once


def test_relay_accepts_the_state_it_rescued_itself_after_the_fence(tmp_path: Path) -> None:
    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    parent = lineage.parent_run("t", "relay_t", "run-1")
    old = lineage.attempt_run(parent, 0, 1, {"segment": 0})
    _publish(lineage, old, 20, tmp_path)
    lineage.fence_attempt(old, "replaced after hang (try 1)")
    _publish(lineage, old, 35, tmp_path)  # the rescued state, published by Relay
    accepted = lineage.fence_attempt(old, "replaced after hang (try 1)", accept=("step-00000035",))

    assert accepted == ["step-00000020", "step-00000035"]
    assert lineage.client.get_run(old).data.tags[TAG_FENCED_CHECKPOINTS] == ",".join(accepted)
    latest, _ = lineage.resume_point(parent, tmp_path / "download")
    assert latest is not None and latest.manifest.step == 35


def test_an_unfenced_attempt_keeps_every_checkpoint(tmp_path: Path) -> None:
    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    parent = lineage.parent_run("t", "relay_t", "run-1")
    run = lineage.attempt_run(parent, 0, 1, {"segment": 0})
    for step in (20, 40):
        _publish(lineage, run, step, tmp_path)
    assert [m.step for m in lineage.manifests(parent)] == [40, 20]
