"""Signed checkpoints: a forged or unsigned checkpoint is refused before anything is
unpickled, and the run resumes from the checkpoint before it.

Whoever can write to MLflow can write a checkpoint *and* its manifest, sha256s included.
Here that attacker logs a checkpoint whose pickle, if it were ever loaded, would create a
marker file: a ``torch.save`` file, or a DCP folder whose ``.metadata`` (which
``torch.distributed.checkpoint`` unpickles with plain pickle) does it. Real ranks (real
Sessions over gloo, a real MLflow store) save the good checkpoints; Relay's side chooses
the resume point; real ranks resume from it, and are also handed the forged one directly.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import time
from pathlib import Path
from typing import Any

import pytest
import signed_ranks
import torch.multiprocessing as mp

from relay.core.checkpoint_keys import checkpoint_keys
from relay.launchers.local.launcher import free_port
from relay.lineage.store import Lineage
from relay.lineage.tags import TAG_REJECTED
from relay.policy.model import load_policy
from relay.recover.corrupt import record_corrupt
from relay_train.checkpoints.publish import MlflowCheckpointSink
from relay_train.protocol.launch import LaunchConfig, ResumeFrom
from relay_train.protocol.manifest import (
    CHECKPOINT_FILE,
    DCP_DIR,
    FORMAT_DCP,
    FORMAT_TORCH,
    CheckpointManifest,
    file_sha256,
    files_digest,
    tree_sha256s,
)
from relay_train.protocol.signing import KeyRing, sign

pytestmark = pytest.mark.integration

POLICY = Path(__file__).resolve().parents[2] / "policies" / "default.yaml"
GOOD, FORGED = 4, 6  # the good checkpoints are at steps 2 and GOOD; the forgery at FORGED


class Payload:
    """Unpickling this creates ``marker``: what a forged pickle would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (self.marker, "w")


def _launch(root: Path, lineage: Lineage, run_id: str, resume: ResumeFrom | None) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    cfg = LaunchConfig(
        job="signed", seed=1, model={}, data={}, optimizer={},
        start_step=resume.step if resume else 0, end_step=10, checkpoint_every=2,
        nodes=["node-a"], ranks_per_node=signed_ranks.WORLD_SIZE, tracking_uri=lineage.tracking_uri,
        run_id=run_id, attempt_dir=str(root), attempt=1, segment=0, master_addr="127.0.0.1",
        master_port=free_port(), backend="gloo", resume=resume,
        checkpoint_keys=checkpoint_keys().to_dict())
    return dataclasses.asdict(cfg)


def _spawn(fn: Any, *args: Any) -> None:  # noqa: ANN401
    mp.start_processes(fn, args=args, nprocs=signed_ranks.WORLD_SIZE, start_method="spawn",
                       join=True)


def _forge(tmp_path: Path, lineage: Lineage, run_id: str, fmt: str, marker: Path,
           how: str) -> CheckpointManifest:
    """Log a checkpoint at step FORGED straight to MLflow, as an attacker with write access
    would: the payload, then a manifest whose sha256s match it, unsigned or signed with a
    key that is not the deployment's."""
    made = tmp_path / "forged"
    made.mkdir()
    if fmt == FORMAT_DCP:
        path = made / DCP_DIR
        path.mkdir()
        (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        (path / "__0_0.distcp").write_bytes(b"\0" * 64)
        files = tree_sha256s(path)
        sha256, size = files_digest(files), sum(p.stat().st_size for p in path.iterdir())
    else:
        path = made / CHECKPOINT_FILE
        path.write_bytes(pickle.dumps({"step": FORGED, "model": Payload(marker)}))
        files, sha256, size = {}, file_sha256(path), path.stat().st_size
    manifest = CheckpointManifest(
        step=FORGED, sha256=sha256, size_bytes=size, world_size=signed_ranks.WORLD_SIZE,
        job="signed", run_id=run_id, parent=None, created_at=time.time(), format=fmt,
        files=files)
    if how == "signed with another key":  # the deployment's key id, an attacker's secret
        manifest = sign(manifest, KeyRing(write=checkpoint_keys().write,
                                          keys={checkpoint_keys().write: "x" * 64}))
    MlflowCheckpointSink(lineage.tracking_uri, run_id).publish(path, manifest)
    return manifest


def _outcomes(root: Path) -> list[dict[str, Any]]:
    return [json.loads((root / f"rank{r}-outcome.json").read_text())
            for r in range(signed_ranks.WORLD_SIZE)]


@pytest.mark.parametrize(("fmt", "how"), [(FORMAT_TORCH, "unsigned"),
                                          (FORMAT_DCP, "signed with another key")])
def test_a_forged_checkpoint_is_refused_before_unpickling_and_the_run_resumes_before_it(
    tmp_path: Path, fmt: str, how: str
) -> None:
    sharded = fmt == FORMAT_DCP
    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    parent = lineage.parent_run("signed", "relay_signed", "run-1")
    first = lineage.attempt_run(parent, 0, 1, {"segment": 0})
    _spawn(signed_ranks.save_ranks,
           _launch(tmp_path / "try-1", lineage, first, None), [2, GOOD], sharded)
    marker = tmp_path / "PWNED"
    forged = _forge(tmp_path, lineage, first, fmt, marker, how)

    # Relay's side: the forgery is corrupt, recorded and skipped; its bytes never fetched.
    download = tmp_path / "download"
    latest, corrupt = lineage.resume_point(parent, download)
    assert latest is not None and latest.manifest.step == GOOD
    assert latest.manifest.format == fmt and latest.manifest.signature
    assert [(c.manifest.step, c.forged) for c in corrupt] == [(FORGED, True)]
    expected = "unsigned" if how == "unsigned" else "bad signature"
    assert corrupt[0].detail.startswith(expected)
    assert not (download / f"step-{FORGED:08d}").exists() or not any(
        (download / f"step-{FORGED:08d}").iterdir())
    retry = lineage.attempt_run(parent, 0, 2, {"segment": 0})
    assert record_corrupt(lineage, retry, corrupt, load_policy(POLICY), [], 0) is None
    tags = lineage.client.get_run(first).data.tags
    assert tags[TAG_REJECTED + f"step-{FORGED:08d}"].startswith("corrupt: checkpoint at step ")
    again, corrupt_again = lineage.resume_point(parent, tmp_path / "again")
    assert corrupt_again == [] and again is not None and again.manifest.step == GOOD

    # The ranks (the same two processes, one launch after the other): they resume from the
    # previous checkpoint, bit for bit, and handed the forgery itself, every rank refuses it
    # before fetching a byte.
    good_root, forged_root = tmp_path / "try-2", tmp_path / "try-3"
    point = dataclasses.replace(latest.resume_from(), step=FORGED, sha256=forged.sha256,
                                files=dict(forged.files), manifest=forged.to_json(),
                                artifact=latest.artifact_uri.replace(
                                    f"step-{GOOD:08d}", f"step-{FORGED:08d}"))
    _spawn(signed_ranks.resume_each, [_launch(good_root, lineage, retry, latest.resume_from()),
                                      _launch(forged_root, lineage, retry, point)], sharded)
    weights = signed_ranks.model_state(GOOD)["model"]["weight"].flatten().tolist()
    assert _outcomes(good_root) == [{"loaded": GOOD, "weights": weights}] * 2
    for outcome in _outcomes(forged_root):
        assert outcome["refused"].startswith(f"checkpoint at step {FORGED} of run {first}: "
                                             f"{expected}")
        assert "resumes from the previous checkpoint" in outcome["refused"]
    assert not list((forged_root / "resume").rglob(f"step-{FORGED:08d}-*"))  # never fetched
    assert not marker.exists()


def test_the_forgery_would_run_its_code_if_it_were_loaded(tmp_path: Path) -> None:
    """The marker is a real test: the forged DCP ``.metadata`` runs code when unpickled."""
    marker = tmp_path / "PWNED"
    data = pickle.dumps(Payload(marker))
    assert not marker.exists()
    pickle.loads(data)  # noqa: S301 - the point of the test
    assert marker.exists()
