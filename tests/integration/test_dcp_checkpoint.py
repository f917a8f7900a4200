"""DCP (sharded) checkpoints end to end: 2 gloo ranks on CPU, FSDP2, a real MLflow store.

The ranks save asynchronously, rank 0 publishes folder + manifest to MLflow; Relay's
resume-point selection downloads and verifies every file; fresh ranks load it and go
on bit for bit. A file damaged after it was logged is refused by both sides, and
Relay falls back to the previous checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import dcp_ranks
import pytest
import torch
import torch.multiprocessing as mp

from relay.launchers.local.ports import listen_port
from relay.lineage.store import Lineage
from relay_train.protocol.manifest import DCP_DIR, FORMAT_DCP, files_digest

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # `make test-slow`


@dataclass
class SavedRun:
    """What the saving ranks left: the lineage, its runs and their dumps."""

    lineage: Lineage
    parent: str
    run_id: str
    work: Path


def spawn(fn: Any, *args: Any) -> None:  # noqa: ANN401
    """Run ``fn(rank, port, *args)`` on 2 ranks; re-raise a rank's failure."""
    mp.start_processes(fn, args=(listen_port(), *args), nprocs=dcp_ranks.WORLD_SIZE,
                       start_method="spawn", join=True)


def shards(work: Path, name: str) -> list[dict[str, Any]]:
    """Return every rank's dump ``rank{r}-{name}.pt``."""
    return [torch.load(work / f"rank{r}-{name}.pt", weights_only=True)
            for r in range(dcp_ranks.WORLD_SIZE)]


def assert_equal(actual: Any, expected: Any, where: str = "") -> None:  # noqa: ANN401
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), f"{where}: tensors differ"
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for key in expected:
            assert_equal(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_equal(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SavedRun]:
    """Train 5 steps on 2 ranks, with DCP checkpoints after steps 2 and 4 in MLflow."""
    root = tmp_path_factory.mktemp("dcp")
    lineage = Lineage(f"sqlite:///{root / 'mlflow.db'}", root / "artifacts")
    parent = lineage.parent_run(dcp_ranks.JOB, "relay_dcp", "run-1")
    run_id = lineage.attempt_run(parent, 0, 1, {"segment": 0})
    work = root / "work"
    work.mkdir()
    spawn(dcp_ranks.save_ranks, str(work), lineage.tracking_uri, run_id)
    yield SavedRun(lineage, parent, run_id, work)


def test_ranks_publish_each_dcp_checkpoint_with_a_sha256_per_file(saved: SavedRun) -> None:
    published = json.loads((saved.work / "published.json").read_text())
    assert [(p["step"], p["format"], p["parent"]) for p in published] == [
        (2, FORMAT_DCP, None), (4, FORMAT_DCP, 2)]
    manifests = saved.lineage.manifests(saved.parent)
    assert [m.step for m in manifests] == [4, 2]
    for manifest in manifests:
        # One data file per rank, plus the coordinator's metadata.
        assert sorted(manifest.files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert manifest.sha256 == files_digest(manifest.files)
    assert manifests[0].parent == manifests[1].ref


def test_fresh_ranks_resume_from_the_verified_folder_bit_for_bit(
    saved: SavedRun, tmp_path: Path
) -> None:
    latest, corrupt = saved.lineage.resume_point(saved.parent, tmp_path / "download")
    assert corrupt == [] and latest is not None
    assert (latest.manifest.step, latest.path.name) == (4, DCP_DIR)
    resume = latest.resume_from()
    assert (resume.format, resume.files) == (FORMAT_DCP, latest.manifest.files)
    older = saved.lineage.manifests(saved.parent)[1]
    assert older.step == 2

    work = tmp_path / "resume"
    work.mkdir()
    step2 = replace(resume, path=str(_download(saved, older.step, tmp_path)), step=2,
                    sha256=older.sha256, files=dict(older.files))
    spawn(dcp_ranks.resume_ranks, str(work),
          {"step4": dcp_ranks.resume_fields(resume), "step2": dcp_ranks.resume_fields(step2)})

    for r in range(dcp_ranks.WORLD_SIZE):
        outcome = json.loads((work / f"rank{r}-outcome.json").read_text())
        assert outcome == {"step4": "loaded: step 4", "step2": "loaded: step 2"}
    # Saved asynchronously while training went on, each holds its own step's state ...
    assert_equal(shards(work, "step4-loaded"), shards(saved.work, "step4"), "step 4")
    assert_equal(shards(work, "step2-loaded"), shards(saved.work, "step2"), "step 2")
    # ... and the next step from it (weights and AdamW state) is the original run's.
    assert_equal(shards(work, "step4-trained"), shards(saved.work, "step5"), "step 5")
    assert_equal(shards(work, "step2-trained"), shards(saved.work, "step3"), "step 3")


def test_a_file_damaged_after_logging_is_refused_and_relay_falls_back(
    saved: SavedRun, tmp_path: Path
) -> None:
    good, _ = saved.lineage.resume_point(saved.parent, tmp_path / "before")
    assert good is not None and good.manifest.step == 4
    logged = _artifact_root(saved) / "checkpoints/step-00000004" / DCP_DIR / "__1_0.distcp"
    original = logged.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01
    logged.write_bytes(bytes(data))
    try:
        _refused_and_fallen_back(saved, good, tmp_path)
    finally:
        logged.write_bytes(original)  # the module's other tests share the store


def _refused_and_fallen_back(saved: SavedRun, good: Any, tmp_path: Path) -> None:  # noqa: ANN401
    expected = good.manifest.files["__1_0.distcp"]

    # The Airflow side: step 4 is corrupt, the previous checkpoint is the resume point.
    latest, corrupt = saved.lineage.resume_point(saved.parent, tmp_path / "after")
    assert latest is not None and latest.manifest.step == 2
    assert [c.manifest.step for c in corrupt] == [4]
    assert "__1_0.distcp: expected sha256 " + expected in corrupt[0].detail
    assert corrupt[0].actual_sha256 != good.manifest.sha256

    # The worker side: handed the damaged folder anyway, both ranks refuse to load it.
    damaged = replace(good.resume_from(), path=str(tmp_path / "after/step-00000004" / DCP_DIR))
    work = tmp_path / "resume"
    work.mkdir()
    spawn(dcp_ranks.resume_ranks, str(work), {"damaged": dcp_ranks.resume_fields(damaged)})
    for r in range(dcp_ranks.WORLD_SIZE):
        outcome = json.loads((work / f"rank{r}-outcome.json").read_text())["damaged"]
        assert outcome.startswith("refused: ")
        assert f"__1_0.distcp: expected sha256 {expected}, found " in outcome
        assert "resume from the previous checkpoint" in outcome
        assert not (work / f"rank{r}-damaged-loaded.pt").exists()


def _artifact_root(saved: SavedRun) -> Path:
    return Path(urlparse(saved.lineage.client.get_run(saved.run_id).info.artifact_uri).path)


def _download(saved: SavedRun, step: int, where: Path) -> Path:
    target = where / f"older-{step}"
    target.mkdir()
    return Path(saved.lineage.client.download_artifacts(
        saved.run_id, f"checkpoints/step-{step:08d}/{DCP_DIR}", str(target)))
