"""Unit tests for snapshots, the (a)synchronous Checkpointer and verified loads."""

from __future__ import annotations

import json
import random
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from relay.core.checkpoint_keys import checkpoint_keys
from relay_train.checkpoints.checkpointer import (
    Checkpointer,
    load_verified,
    restore_rng,
    snapshot,
)
from relay_train.errors import CorruptCheckpointError
from relay_train.protocol.manifest import (
    CHECKPOINT_FILE,
    CheckpointManifest,
    CheckpointRef,
    file_sha256,
    step_dir,
)

KEYS = checkpoint_keys()  # the test session's key ring ($RELAY_HOME's key file)

RUN_ID = "run-abc"
ROOT_PARENT = CheckpointRef(run_id="run-earlier", step=0, sha256="0" * 64)


class FolderSink:
    """A CheckpointSink that copies each checkpoint into a folder and records the calls."""

    def __init__(
        self,
        folder: Path,
        *,
        fail_at_step: int | None = None,
        gate_at_step: int | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.run_id = RUN_ID
        self.folder = folder
        self.calls: list[int] = []
        self.published: list[tuple[Path, CheckpointManifest]] = []
        self.fail_at_step = fail_at_step
        self.gate_at_step = gate_at_step
        self.gate = gate
        self.gate_timed_out = False

    def publish(self, checkpoint: Path, manifest: CheckpointManifest) -> None:
        self.calls.append(manifest.step)
        if self.gate is not None and manifest.step == self.gate_at_step:
            self.gate_timed_out = not self.gate.wait(10)
        if manifest.step == self.fail_at_step:
            raise OSError(f"sink is full at step {manifest.step}")
        dest = self.folder / step_dir(manifest.step)
        dest.mkdir(parents=True)
        shutil.copyfile(checkpoint, dest / CHECKPOINT_FILE)
        (dest / "manifest.json").write_text(manifest.to_json())
        self.published.append((dest / CHECKPOINT_FILE, manifest))


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A tiny model and AdamW after one real step (so the optimizer has state)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def clone_state(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(clone_state(v) for v in obj)
    return obj


def assert_state_equal(actual: object, expected: object) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        assert torch.equal(actual, expected), f"{actual} != {expected}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict)
        assert set(actual) == set(expected)
        for key in expected:
            assert_state_equal(actual[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_state_equal(a, e)
    else:
        assert actual == expected


def new_checkpointer(tmp_path: Path, sink: FolderSink, closing: list[Checkpointer] | None = None,
                     **options: Any) -> Checkpointer:
    """Return a checkpointer publishing to ``sink`` (job "j", one rank, no parent, the test
    key ring, unless ``options`` say otherwise); ``closing``: closed after the test."""
    checkpointer = Checkpointer(sink, tmp_path / "staging", **{
        "job": "j", "world_size": 1, "parent": None, "keys": KEYS, **options})
    if closing is not None:
        closing.append(checkpointer)
    return checkpointer


@pytest.fixture
def closing() -> Iterator[list[Checkpointer]]:
    """Checkpointers made by a test, closed afterwards (errors already checked)."""
    made: list[Checkpointer] = []
    yield made
    for checkpointer in made:
        try:
            checkpointer.close(timeout_seconds=10)
        except (RuntimeError, TimeoutError):
            pass


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_publishes_every_checkpoint_in_order_with_a_parent_chain(
    tmp_path: Path, asynchronous: bool
) -> None:
    model, optimizer = make_model()
    sink = FolderSink(tmp_path / "sink")
    seen: list[int] = []
    checkpointer = new_checkpointer(tmp_path, sink, job="demo", world_size=4,
                                    parent=ROOT_PARENT, asynchronous=asynchronous,
                                    on_published=lambda m: seen.append(m.step))
    steps = [10, 20, 30, 40]
    for step in steps:
        train_step(model, optimizer)
        stats = checkpointer.save(model, optimizer, step, {"data": {"position": step}})
        assert stats.step == step
        assert stats.stall_seconds >= 0
    checkpointer.close()

    assert sink.calls == steps
    assert seen == steps
    manifests = [m for _, m in sink.published]
    assert [m.step for m in manifests] == steps
    assert checkpointer.published == manifests
    expected_parent = ROOT_PARENT
    for path, manifest in sink.published:
        assert file_sha256(path) == manifest.sha256
        assert path.stat().st_size == manifest.size_bytes
        assert manifest.parent == expected_parent
        assert (manifest.run_id, manifest.job, manifest.world_size) == (RUN_ID, "demo", 4)
        assert load_verified(path, manifest.sha256)["step"] == manifest.step
        expected_parent = manifest.ref
    assert expected_parent == CheckpointRef(RUN_ID, 40, manifests[-1].sha256)


def test_first_checkpoint_without_parent_has_none(tmp_path: Path) -> None:
    model, optimizer = make_model()
    sink = FolderSink(tmp_path / "sink")
    checkpointer = new_checkpointer(tmp_path, sink, job="demo", asynchronous=False)
    checkpointer.save(model, optimizer, 5, {})
    checkpointer.save(model, optimizer, 6, {})
    checkpointer.close()

    first, second = (m for _, m in sink.published)
    assert first.parent is None
    assert second.parent == first.ref


def test_submitted_work_runs_in_order_with_checkpoints(tmp_path: Path, closing: list) -> None:
    model, optimizer = make_model()
    sink = FolderSink(tmp_path / "sink")
    checkpointer = new_checkpointer(tmp_path, sink, closing)
    order: list[str] = []
    checkpointer.save(model, optimizer, 1, {})
    checkpointer.submit(lambda: order.append(f"metrics after {sink.calls}"))
    checkpointer.save(model, optimizer, 2, {})
    checkpointer.close()

    assert order == ["metrics after [1]"]
    assert sink.calls == [1, 2]


def test_async_snapshot_is_a_copy_of_the_live_state(tmp_path: Path, closing: list) -> None:
    model, optimizer = make_model()
    gate = threading.Event()
    # The sink holds the background thread inside publish(1), so checkpoint 2
    # is written to disk only after the test has changed the live weights.
    sink = FolderSink(tmp_path / "sink", gate_at_step=1, gate=gate)
    checkpointer = new_checkpointer(tmp_path, sink, closing)

    checkpointer.save(model, optimizer, 1, {})
    expected_model = clone_state(model.state_dict())
    expected_optimizer = clone_state(optimizer.state_dict())
    checkpointer.save(model, optimizer, 2, {"data": {"position": 2}})
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(42.0)
    for state in optimizer.state.values():
        state["exp_avg"].fill_(-7.0)
    gate.set()
    checkpointer.close(timeout_seconds=10)

    assert not sink.gate_timed_out
    path, manifest = sink.published[1]
    state = load_verified(path, manifest.sha256)
    assert state["step"] == 2
    assert state["data"] == {"position": 2}
    assert_state_equal(state["model"], expected_model)
    assert_state_equal(state["optimizer"], expected_optimizer)
    assert not torch.equal(state["model"]["weight"], model.weight.detach())


def test_snapshot_copies_tensors_and_extra() -> None:
    model, optimizer = make_model()
    extra = {"data": {"position": 3, "history": [torch.ones(2)]}}
    state = snapshot(model, optimizer, 3, extra)
    with torch.no_grad():
        model.weight.add_(1.0)
    extra["data"]["history"][0].add_(1.0)

    assert not torch.equal(state["model"]["weight"], model.weight.detach())
    assert torch.equal(state["data"]["history"][0], torch.ones(2))
    assert state["step"] == 3


def test_failing_sink_surfaces_from_close_and_stops_later_publishes(
    tmp_path: Path, closing: list
) -> None:
    model, optimizer = make_model()
    gate = threading.Event()
    sink = FolderSink(tmp_path / "sink", fail_at_step=2, gate_at_step=2, gate=gate)
    checkpointer = new_checkpointer(tmp_path, sink, closing)

    checkpointer.save(model, optimizer, 1, {})
    checkpointer.save(model, optimizer, 2, {})
    checkpointer.save(model, optimizer, 3, {})  # queued while publish(2) is held
    ran_after_failure: list[bool] = []
    checkpointer.submit(lambda: ran_after_failure.append(True))
    gate.set()

    with pytest.raises(RuntimeError, match="failed to publish") as info:
        checkpointer.close(timeout_seconds=10)

    assert isinstance(info.value.__cause__, OSError)
    assert "sink is full at step 2" in str(info.value.__cause__)
    assert sink.calls == [1, 2]
    assert [m.step for _, m in sink.published] == [1]
    assert [m.step for m in checkpointer.published] == [1]
    assert ran_after_failure == []
    with pytest.raises(RuntimeError, match="failed to publish"):
        checkpointer.save(model, optimizer, 4, {})
    assert sink.calls == [1, 2]


def test_sync_sink_failure_raises_from_save(tmp_path: Path) -> None:
    model, optimizer = make_model()
    sink = FolderSink(tmp_path / "sink", fail_at_step=1)
    checkpointer = new_checkpointer(tmp_path, sink, asynchronous=False)
    with pytest.raises(OSError, match="sink is full"):
        checkpointer.save(model, optimizer, 1, {})
    assert checkpointer.published == []


def test_load_verified_round_trips_state(tmp_path: Path) -> None:
    model, optimizer = make_model()
    sink = FolderSink(tmp_path / "sink")
    checkpointer = new_checkpointer(tmp_path, sink, asynchronous=False)
    checkpointer.save(model, optimizer, 12, {"data": {"position": 12, "seed": 7}})
    path, manifest = sink.published[0]

    state = load_verified(path, manifest.sha256)

    assert state["step"] == 12
    assert state["data"] == {"position": 12, "seed": 7}
    assert_state_equal(state["model"], model.state_dict())
    fresh = nn.Linear(4, 3)
    fresh.load_state_dict(state["model"])
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh_opt.load_state_dict(state["optimizer"])
    assert_state_equal(fresh_opt.state_dict()["state"], optimizer.state_dict()["state"])


def test_load_verified_rejects_a_flipped_byte(tmp_path: Path) -> None:
    model, optimizer = make_model()
    sink = FolderSink(tmp_path / "sink")
    checkpointer = new_checkpointer(tmp_path, sink, asynchronous=False)
    checkpointer.save(model, optimizer, 1, {})
    path, manifest = sink.published[0]
    damaged = tmp_path / "damaged.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))

    with pytest.raises(CorruptCheckpointError, match=manifest.sha256):
        load_verified(damaged, manifest.sha256)
    assert load_verified(path, manifest.sha256)["step"] == 1


def test_restore_rng_replays_the_draws_after_the_snapshot(tmp_path: Path) -> None:
    model, optimizer = make_model()
    sink = FolderSink(tmp_path / "sink")
    checkpointer = new_checkpointer(tmp_path, sink, asynchronous=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        random.seed(99)
        checkpointer.save(model, optimizer, 1, {})
        expected_torch = torch.rand(5)
        expected_python = random.random()
        torch.rand(100)  # move on, as the run would
        random.random()

        path, manifest = sink.published[0]
        restore_rng(load_verified(path, manifest.sha256))

        assert torch.equal(torch.rand(5), expected_torch)
        assert random.random() == expected_python


def test_manifest_json_round_trip() -> None:
    with_parent = CheckpointManifest(
        step=40,
        sha256="ab" * 32,
        size_bytes=1234,
        world_size=4,
        job="demo",
        run_id="run-2",
        parent=CheckpointRef(run_id="run-1", step=20, sha256="cd" * 32),
        created_at=1700000000.25,
    )
    without_parent = CheckpointManifest(
        step=20,
        sha256="cd" * 32,
        size_bytes=1000,
        world_size=4,
        job="demo",
        run_id="run-1",
        parent=None,
        created_at=1690000000.5,
    )
    for manifest in (with_parent, without_parent):
        assert CheckpointManifest.from_json(manifest.to_json()) == manifest
    assert with_parent.parent == without_parent.ref
    assert with_parent.ref.artifact_dir == "checkpoints/step-00000040"


@pytest.mark.parametrize(
    "text",
    [
        "not json at all",
        "",
        "{}",
        '{"step": 1}',
        json.dumps({"step": 1, "sha256": "x", "size_bytes": 1, "world_size": 1, "job": "j"}),
        json.dumps(
            {
                "step": 1,
                "sha256": "x",
                "size_bytes": 1,
                "world_size": 1,
                "job": "j",
                "run_id": "r",
                "created_at": 0,
                "parent": {"run_id": "r", "bogus": 1},
            }
        ),
        json.dumps(
            {
                "step": "one",
                "sha256": "x",
                "size_bytes": 1,
                "world_size": 1,
                "job": "j",
                "run_id": "r",
                "created_at": 0,
            }
        ),
    ],
)
def test_manifest_from_json_raises_value_error_on_junk(text: str) -> None:
    with pytest.raises(ValueError):
        CheckpointManifest.from_json(text)


@pytest.mark.parametrize("text", ["[]", "null", "42", '"manifest"'])
def test_manifest_from_json_raises_value_error_on_non_object_json(text: str) -> None:
    with pytest.raises(ValueError):
        CheckpointManifest.from_json(text)


def test_flush_waits_until_the_checkpoints_queued_so_far_are_published(
    tmp_path: Path, closing: list
) -> None:
    """A boundary waits for its checkpoint to be in MLflow before training past it."""
    model, optimizer = make_model()
    gate = threading.Event()
    sink = FolderSink(tmp_path / "sink", gate_at_step=30, gate=gate)
    checkpointer = new_checkpointer(tmp_path, sink, closing)
    checkpointer.save(model, optimizer, 30, {})
    assert checkpointer.flush(0.3) is False  # the upload of step 30 still runs
    assert [m.step for _p, m in sink.published] == []
    gate.set()
    assert checkpointer.flush(10.0) is True
    assert [m.step for _p, m in sink.published] == [30]
