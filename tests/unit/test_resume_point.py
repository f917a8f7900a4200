"""Choosing where to resume reads the newest checkpoints only, not the job's whole history
(real MLflow store on disk, real checkpoint files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_fencing import _publish

from relay.lineage import Lineage


class CountingClient:
    """The real MlflowClient, counting the manifests and checkpoints downloaded."""

    def __init__(self, client: Any) -> None:  # noqa: ANN401 - an MlflowClient
        self._client = client
        self.downloads: list[str] = []

    def download_artifacts(self, run_id: str, path: str, dst: str) -> str:
        self.downloads.append(path)
        return self._client.download_artifacts(run_id, path, dst)

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        return getattr(self._client, name)


def test_the_resume_point_reads_the_newest_checkpoint_only(tmp_path: Path) -> None:
    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    parent = lineage.parent_run("t", "relay_t", "run-1")
    for segment, steps in enumerate([(10, 20, 30), (40, 50, 60), (70, 80)]):
        run = lineage.attempt_run(parent, segment, 1, {"segment": segment})
        for step in steps:
            _publish(lineage, run, step, tmp_path / f"s{segment}")
    counting = CountingClient(lineage.client)
    lineage._client = counting  # the real client underneath, counting its downloads

    latest, corrupt = lineage.resume_point(parent, tmp_path / "download")

    assert latest is not None and latest.manifest.step == 80 and corrupt == []
    assert [p.rsplit("/", 1)[0] for p in counting.downloads] == [
        "checkpoints/step-00000080", "checkpoints/step-00000080"]  # its manifest, its file
    assert [m.step for m in lineage.manifests(parent)] == [80, 70, 60, 50, 40, 30, 20, 10]


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(tmp_path: Path) -> None:
    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    parent = lineage.parent_run("t", "relay_t", "run-1")
    run = lineage.attempt_run(parent, 0, 1, {"segment": 0})
    for step in (10, 20, 30):
        _publish(lineage, run, step, tmp_path)
    stored = next((tmp_path / "artifacts").rglob("step-00000030/checkpoint.pt"))
    stored.write_bytes(b"damaged")

    latest, corrupt = lineage.resume_point(parent, tmp_path / "download")

    assert latest is not None and latest.manifest.step == 20
    assert [c.manifest.step for c in corrupt] == [30]


def test_has_checkpoint_reads_down_to_the_step_only(tmp_path: Path) -> None:
    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    parent = lineage.parent_run("t", "relay_t", "run-1")
    run = lineage.attempt_run(parent, 0, 1, {"segment": 0})
    for step in (10, 20, 30, 40):
        _publish(lineage, run, step, tmp_path)
    counting = CountingClient(lineage.client)
    lineage._client = counting

    assert lineage.has_checkpoint(parent, 30)
    assert [p.rsplit("/", 1)[0] for p in counting.downloads] == [
        "checkpoints/step-00000040", "checkpoints/step-00000030"]  # two manifests, no more
    assert not lineage.has_checkpoint(parent, 25)
    assert not lineage.has_checkpoint(parent, 50)
