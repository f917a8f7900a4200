"""Ranks fetch their resume checkpoint from MLflow themselves (a real file store)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from relay_train.checkpoints.checkpointer import load_verified
from relay_train.checkpoints.fetch import fetch_resume
from relay_train.checkpoints.publish import MlflowCheckpointSink
from relay_train.errors import CorruptCheckpointError
from relay_train.protocol.launch import ResumeFrom
from relay_train.protocol.manifest import (
    FORMAT_DCP,
    CheckpointManifest,
    file_sha256,
    files_digest,
    tree_sha256s,
)


def _store(tmp_path: Path) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("fetch", artifact_location=(tmp_path / "art").as_uri())
    return uri, client.create_run(exp).info.run_id


def _published(tmp_path: Path, step: int = 40) -> tuple[str, CheckpointManifest]:
    uri, run_id = _store(tmp_path)
    path = tmp_path / "staged" / "checkpoint.pt"
    path.parent.mkdir()
    torch.save({"step": step, "w": torch.arange(6.0)}, path)
    manifest = CheckpointManifest(step, file_sha256(path), path.stat().st_size, 4, "fetch",
                                  run_id, None, time.time())
    MlflowCheckpointSink(uri, run_id).publish(path, manifest)
    return uri, manifest


def _resume(manifest: CheckpointManifest, uri: str) -> ResumeFrom:
    """Return the resume point Relay's task hands the ranks (as lineage.resume_point does)."""
    base = MlflowClient(tracking_uri=uri).get_run(manifest.run_id).info.artifact_uri
    return ResumeFrom(path="/nowhere/on/this/node", sha256=manifest.sha256,
                      run_id=manifest.run_id, step=manifest.step, format=manifest.format,
                      files=dict(manifest.files), artifact=f"{base}/{manifest.artifact}")


def test_a_rank_fetches_and_verifies_without_relays_download(tmp_path: Path) -> None:
    uri, manifest = _published(tmp_path)
    got = fetch_resume(_resume(manifest, uri), uri, tmp_path / "node-a")
    assert Path(got.path).is_relative_to(tmp_path / "node-a")
    assert torch.equal(load_verified(Path(got.path), got.sha256)["w"], torch.arange(6.0))


def test_one_download_per_node_the_other_ranks_reuse_it(tmp_path: Path) -> None:
    uri, manifest = _published(tmp_path)
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(
        fetch_resume(_resume(manifest, uri), uri, tmp_path / "node-a").path)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    marker = next((tmp_path / "node-a").glob("*/.verified"))
    # Damage the cached copy: a later rank on the node trusts the marker, the loader does not.
    Path(results[0]).write_bytes(b"damaged")
    again = fetch_resume(_resume(manifest, uri), uri, tmp_path / "node-a")
    assert marker.exists()
    with pytest.raises(CorruptCheckpointError):
        load_verified(Path(again.path), again.sha256)


def test_a_damaged_artifact_is_refused_and_not_marked(tmp_path: Path) -> None:
    uri, manifest = _published(tmp_path)
    stored = next((tmp_path / "art").rglob("checkpoint.pt"))
    stored.write_bytes(stored.read_bytes()[:-8] + b"12345678")
    with pytest.raises(CorruptCheckpointError, match="does not match its manifest"):
        fetch_resume(_resume(manifest, uri), uri, tmp_path / "node-a")
    assert not list((tmp_path / "node-a").glob("*/.verified"))


def test_an_unreachable_artifact_names_the_run_and_the_fix(tmp_path: Path) -> None:
    uri, manifest = _published(tmp_path)
    resume = _resume(manifest, uri)
    gone = dataclasses.replace(resume, artifact=resume.artifact.replace("/art/", "/moved/"))
    with pytest.raises(RuntimeError, match="(?s)could not be downloaded .*artifact store"):
        fetch_resume(gone, uri, tmp_path / "node-a")


def test_a_dcp_folder_is_fetched_file_by_file(tmp_path: Path) -> None:
    uri, run_id = _store(tmp_path)
    folder = tmp_path / "staged" / "dcp"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"shard zero")
    (folder / ".metadata").write_bytes(b"meta")
    files = tree_sha256s(folder)
    manifest = CheckpointManifest(30, files_digest(files), 14, 2, "fetch", run_id, None,
                                  time.time(), format=FORMAT_DCP, files=files)
    MlflowCheckpointSink(uri, run_id).publish(folder, manifest)
    got = fetch_resume(_resume(manifest, uri), uri, tmp_path / "node-b")
    assert tree_sha256s(Path(got.path)) == files


def test_a_resume_point_without_an_artifact_is_used_as_it_is(tmp_path: Path) -> None:
    _, manifest = _published(tmp_path)
    old_style = ResumeFrom(path="/given/path", sha256=manifest.sha256, run_id=manifest.run_id,
                           step=manifest.step)
    assert fetch_resume(old_style, "sqlite:///unused.db", tmp_path / "node-a") is old_style
