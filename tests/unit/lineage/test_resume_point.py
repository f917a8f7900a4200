"""Choosing where to resume reads the newest checkpoints only, not the job's whole history
(real MLflow store on disk, real checkpoint files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from test_fencing import _publish

from relay.lineage.store import Lineage


class CountingClient:
    """The real MlflowClient (or a run's artifact store), counting what is downloaded."""

    def __init__(self, client: Any, downloads: list[str] | None = None) -> None:  # noqa: ANN401
        self._client = client
        self.downloads: list[str] = [] if downloads is None else downloads

    def download_artifacts(self, *args: str) -> str:
        self.downloads.append(args[-2])  # (run_id,) path, dst
        return self._client.download_artifacts(*args)

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        return getattr(self._client, name)


def counting(lineage: Lineage) -> CountingClient:
    """Count every download (the client's and the runs' artifact stores') and run lookup."""
    client = CountingClient(lineage.client)
    lineage._client = client  # the real client underneath
    stores = lineage._artifacts
    lineage._artifacts = lambda run: CountingClient(stores(run), client.downloads)  # type: ignore[method-assign]
    return client


def test_the_resume_point_reads_the_newest_checkpoint_only(tmp_path: Path) -> None:
    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    parent = lineage.parent_run("t", "relay_t", "run-1")
    for segment, steps in enumerate([(10, 20, 30), (40, 50, 60), (70, 80)]):
        run = lineage.attempt_run(parent, segment, 1, {"segment": segment})
        for step in steps:
            _publish(lineage, run, step, tmp_path / f"s{segment}")
    calls = counting(lineage)

    latest, corrupt = lineage.resume_point(parent, tmp_path / "download")

    assert latest is not None and latest.manifest.step == 80 and corrupt == []
    assert [p.rsplit("/", 1)[0] for p in calls.downloads] == [
        "checkpoints/step-00000080", "checkpoints/step-00000080"]  # its manifest, its file
    assert [m.step for m in lineage.manifests(parent)] == [80, 70, 60, 50, 40, 30, 20, 10]


def test_reading_every_manifest_looks_no_run_up_per_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's list and download calls look the run up on each call: reading the
    chain of N checkpoints (finalize) cost 2N run lookups, seconds in a long job."""
    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    parent = lineage.parent_run("t", "relay_t", "run-1")
    for segment, steps in enumerate([(10, 20, 30), (40, 50, 60)]):
        run = lineage.attempt_run(parent, segment, 1, {"segment": segment})
        for step in steps:
            _publish(lineage, run, step, tmp_path / f"s{segment}")
    calls = counting(lineage)
    lookups: list[str] = []  # every run the tracking store is asked for, by anyone
    get_run = SqlAlchemyStore.get_run
    monkeypatch.setattr(SqlAlchemyStore, "get_run",
                        lambda store, run_id: lookups.append(run_id) or get_run(store, run_id))

    manifests = lineage.manifests(parent)

    assert [m.step for m in manifests] == [60, 50, 40, 30, 20, 10]
    assert len(calls.downloads) == 6  # one manifest per checkpoint
    assert lookups == [parent]  # to find its experiment; none per checkpoint (was 2 each)


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
    calls = counting(lineage)

    assert lineage.has_checkpoint(parent, 30)
    assert [p.rsplit("/", 1)[0] for p in calls.downloads] == [
        "checkpoints/step-00000040", "checkpoints/step-00000030"]  # two manifests, no more
    assert not lineage.has_checkpoint(parent, 25)
    assert not lineage.has_checkpoint(parent, 50)


def test_a_whole_chain_is_read_several_at_once_in_the_lazy_readers_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``manifests`` reads ``READERS`` manifests at a time (round trips to a tracking
    server, on the way to a run's end); two attempts that published the same step each
    keep their own manifest, and the order is ``newest_first``'s."""
    import threading

    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    parent = lineage.parent_run("t", "relay_t", "run-1")
    for attempt, steps in enumerate([(10, 20, 30), (30, 40), (40, 50, 60)], start=1):
        run = lineage.attempt_run(parent, 0, attempt, {"attempt": attempt})
        for step in steps:
            _publish(lineage, run, step, tmp_path / f"a{attempt}")
    both_at_once = threading.Barrier(2, timeout=10)  # one by one, the first read waits in vain
    calls: list[int] = []
    manifest = Lineage._manifest

    def reading(self: Lineage, run: Any, path: str, tmp: str) -> Any:  # noqa: ANN401
        calls.append(1)
        if len(calls) <= 2:
            both_at_once.wait()
        return manifest(self, run, path, tmp)

    monkeypatch.setattr(Lineage, "_manifest", reading)

    found = lineage.manifests(parent)

    assert [(m.step, m.run_id) for m in found] == [
        (m.step, m.run_id) for m in lineage.newest_first(parent)]
    assert [m.step for m in found] == [60, 50, 40, 40, 30, 30, 20, 10]
    assert len({m.run_id for m in found if m.step == 30}) == 2  # both attempts' own
