"""Unit tests for DCP checkpoint manifests, folder verification and a single-process save.

The multi-rank path (FSDP2 over gloo, MLflow, Relay's resume point) is in
tests/integration/test_dcp_checkpoint.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from relay.core.checkpoint_keys import checkpoint_keys
from relay_train.checkpoints.checkpointer import Checkpointer, load_verified
from relay_train.checkpoints.dcp import (
    DcpCheckpointer,
    load_dcp,
    load_model,
    model_state,
    verify_dcp,
)
from relay_train.errors import CorruptCheckpointError
from relay_train.protocol.launch import LaunchConfig, ResumeFrom
from relay_train.protocol.manifest import (
    DCP_DIR,
    FORMAT_DCP,
    FORMAT_TORCH,
    MANIFEST_FILE,
    CheckpointManifest,
    FileMismatch,
    files_digest,
    step_dir,
    tree_mismatches,
    tree_sha256s,
)

KEYS = checkpoint_keys()  # the test session's key ring ($RELAY_HOME's key file)

OLD_MANIFEST = {  # as logged before manifests had a format
    "step": 10, "sha256": "ab" * 32, "size_bytes": 5, "world_size": 4, "job": "demo",
    "run_id": "r1", "parent": None, "created_at": 1.5, "version": 1, "origin": "periodic",
}


class FolderSink:
    """A CheckpointSink copying each checkpoint (file or folder) into a folder."""

    run_id = "run-dcp"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.published: list[tuple[Path, CheckpointManifest]] = []

    def publish(self, checkpoint: Path, manifest: CheckpointManifest) -> None:
        dest = self.folder / step_dir(manifest.step)
        dest.mkdir(parents=True)
        shutil.copytree(checkpoint, dest / DCP_DIR)
        (dest / MANIFEST_FILE).write_text(manifest.to_json())
        self.published.append((dest / DCP_DIR, manifest))


def _resume(folder: Path, manifest: CheckpointManifest) -> ResumeFrom:
    return ResumeFrom(path=str(folder), sha256=manifest.sha256, run_id=manifest.run_id,
                      step=manifest.step, format=manifest.format, files=dict(manifest.files))


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def published(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer, Path, CheckpointManifest]:
    """A model saved as DCP at step 7 (one process, no process group) and published."""
    model, optimizer = _trained()
    sink = FolderSink(tmp_path / "sink")
    publisher = Checkpointer(sink, tmp_path / "staging", job="j", world_size=1, parent=None,
                             keys=KEYS)
    saver = DcpCheckpointer(tmp_path / "staging", publisher)
    stats = saver.save_model(model, optimizer, 7, {"position": torch.tensor(7)})
    assert stats.step == 7 and stats.stall_seconds >= 0
    saver.close()
    publisher.close()
    [(folder, manifest)] = sink.published
    return model, optimizer, folder, manifest


def test_old_manifests_still_parse_as_single_file_checkpoints() -> None:
    manifest = CheckpointManifest.from_json(json.dumps(OLD_MANIFEST))
    assert (manifest.format, manifest.files) == (FORMAT_TORCH, {})
    assert CheckpointManifest.from_json(manifest.to_json()) == manifest


def test_dcp_manifest_round_trips_and_its_sha256_names_the_file_table() -> None:
    files = {".metadata": "11" * 32, "__0_0.distcp": "22" * 32}
    raw = {**OLD_MANIFEST, "format": FORMAT_DCP, "files": files, "sha256": files_digest(files)}
    manifest = CheckpointManifest.from_json(json.dumps(raw))
    assert (manifest.format, manifest.files) == (FORMAT_DCP, files)
    assert CheckpointManifest.from_json(manifest.to_json()) == manifest
    assert files_digest({**files, "__0_0.distcp": "33" * 32}) != manifest.sha256
    assert hash(manifest) == hash(manifest)  # still usable as a key


@pytest.mark.parametrize(("change", "message"), [
    ({"format": "zip"}, "field format: expected one of torch, dcp, found 'zip'"),
    ({"format": FORMAT_DCP}, "field files: a dcp checkpoint must list its files"),
    ({"format": FORMAT_DCP, "files": {"a": "1"}}, "field sha256: does not match"),
    ({"files": ["a"]}, "field files: expected an object, found list"),
])
def test_bad_format_fields_are_not_manifests(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointManifest.from_json(json.dumps({**OLD_MANIFEST, **change}))


def test_tree_mismatches_names_changed_missing_and_extra_files(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("a", "b", "sub/c"):
        (tmp_path / name).write_text(name)
    files = tree_sha256s(tmp_path)
    assert sorted(files) == ["a", "b", "sub/c"]
    assert tree_mismatches(tmp_path, files) == []

    (tmp_path / "a").write_text("A")
    (tmp_path / "sub/c").unlink()
    (tmp_path / "d").write_text("d")
    problems = tree_mismatches(tmp_path, files)
    found_a = tree_sha256s(tmp_path)["a"]
    assert problems == [FileMismatch("a", files["a"], found_a),
                        FileMismatch("d", None, tree_sha256s(tmp_path)["d"]),
                        FileMismatch("sub/c", files["sub/c"], None)]
    assert str(problems[0]) == f"a: expected sha256 {files['a']}, found {found_a}"
    assert "not in the manifest" in str(problems[1]) and "missing" in str(problems[2])
    # Two ranks splitting the work see every problem between them, none twice.
    halves = tree_mismatches(tmp_path, files, (0, 2)) + tree_mismatches(tmp_path, files, (1, 2))
    assert sorted(halves, key=str) == sorted(problems, key=str)
    assert tree_mismatches(tmp_path / "gone", {"a": "1"}) == [FileMismatch("a", "1", None)]


def test_a_dcp_save_publishes_every_file_with_its_sha256(published: tuple) -> None:
    _, _, folder, manifest = published
    assert manifest.format == FORMAT_DCP
    assert manifest.files == tree_sha256s(folder)
    assert ".metadata" in manifest.files and len(manifest.files) >= 2
    assert manifest.sha256 == files_digest(manifest.files)
    assert manifest.size_bytes == sum(p.stat().st_size for p in folder.iterdir())


def test_load_model_restores_weights_optimizer_and_extras(published: tuple) -> None:
    model, optimizer, folder, manifest = published
    fresh = nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh(torch.randn(2, 4)).sum().backward()
    fresh_opt.step()  # so the optimizer has state of its own to overwrite

    state = load_model(_resume(folder, manifest), fresh, fresh_opt, {"position": torch.tensor(0)})

    assert int(state["position"]) == 7
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        for p_fresh, p in zip(fresh.parameters(), model.parameters(), strict=True):
            assert torch.equal(fresh_opt.state[p_fresh][key], optimizer.state[p][key])


@pytest.mark.parametrize("damage", ["flip", "delete", "add"])
def test_load_refuses_a_damaged_folder_before_reading_it(
    published: tuple, damage: str
) -> None:
    model, optimizer, folder, manifest = published
    data_file = next(n for n in manifest.files if n.endswith(".distcp"))
    if damage == "flip":
        raw = bytearray((folder / data_file).read_bytes())
        raw[len(raw) // 2] ^= 0x01
        (folder / data_file).write_bytes(bytes(raw))
        expected = f"{data_file}: expected sha256 {manifest.files[data_file]}, found "
    elif damage == "delete":
        (folder / data_file).unlink()
        expected = f"{data_file}: missing (expected sha256 {manifest.files[data_file]})"
    else:
        (folder / "__9_0.distcp").write_bytes(b"stray")
        expected = "__9_0.distcp: not in the manifest"
    fresh = nn.Linear(4, 3)
    before = fresh.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError) as info:
        load_model(_resume(folder, manifest), fresh, torch.optim.AdamW(fresh.parameters()))
    assert expected in str(info.value)
    assert str(folder) in str(info.value) and "previous checkpoint" in str(info.value)
    assert torch.equal(fresh.weight, before)  # nothing was loaded


def test_a_resume_point_whose_file_table_was_altered_is_refused(published: tuple) -> None:
    _, _, folder, manifest = published
    resume = _resume(folder, manifest)
    tampered = ResumeFrom(**{**resume.__dict__, "files": {**resume.files, "x": "0" * 64}})
    with pytest.raises(CorruptCheckpointError, match="file table does not match"):
        verify_dcp(tampered)
    with pytest.raises(ValueError, match="expected format 'dcp', found 'torch'"):
        load_dcp(ResumeFrom(**{**resume.__dict__, "format": FORMAT_TORCH}), {})


def test_single_file_loader_points_a_dcp_folder_to_load_dcp(published: tuple) -> None:
    _, _, folder, manifest = published
    with pytest.raises(ValueError, match="relay_train.checkpoints.dcp.load_dcp"):
        load_verified(folder, manifest.sha256)


def test_model_state_holds_model_optimizer_and_extras() -> None:
    model, optimizer = _trained()
    state = model_state(model, optimizer, {"rng": torch.get_rng_state()})
    assert set(state) == {"model", "optimizer", "rng"}
    assert torch.equal(state["model"]["weight"], model.weight.detach())


def test_launch_files_carry_the_resume_format_and_old_ones_default_to_torch(
    tmp_path: Path,
) -> None:
    resume = ResumeFrom(path="/x/dcp", sha256=files_digest({"a": "1"}), run_id="r", step=3,
                        format=FORMAT_DCP, files={"a": "1"})
    cfg = LaunchConfig(job="j", seed=1, model={}, data={}, optimizer={}, start_step=3,
                       end_step=6, checkpoint_every=3, nodes=["node-a"], ranks_per_node=1,
                       master_addr="127.0.0.1", master_port=1, tracking_uri="sqlite:///x",
                       run_id="r", attempt_dir=str(tmp_path), attempt=1, segment=0,
                       resume=resume)
    cfg.write(tmp_path / "launch.json")
    assert LaunchConfig.read(tmp_path / "launch.json").resume == resume
    raw = json.loads((tmp_path / "launch.json").read_text())
    for key in ("format", "files"):
        del raw["resume"][key]
    (tmp_path / "old.json").write_text(json.dumps(raw))
    old = LaunchConfig.read(tmp_path / "old.json").resume
    assert old is not None and (old.format, old.files) == (FORMAT_TORCH, {})
