"""relay_train.init() outside Relay: a local session with the same calls, a local folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from relay_train import api
from relay_train.local import LocalSession, local_checkpoints

TORCHRUN_ENV = ("RELAY_LAUNCH", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "RELAY_TOTAL_STEPS", "RELAY_CHECKPOINT_DIR")


@pytest.fixture(autouse=True)
def plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Relay, no torchrun: whatever the session sets is undone after the test."""
    for name in TORCHRUN_ENV:
        monkeypatch.setenv(name, "x")  # recorded as absent, so undone if set later
        monkeypatch.delenv(name)
    monkeypatch.setattr(api, "_SESSION", None)


def train(session: LocalSession, weights: torch.Tensor, stop_after: int | None = None) -> None:
    """Add each step's number to ``weights``; stop (as a crash would) after ``stop_after``."""
    session.track(lambda: {"weights": weights})
    session.mark_collectives(torch.nn.Linear(1, 1))  # Relay's calls all exist here
    if (state := session.resume_state()) is not None:
        weights.copy_(state["weights"])
    for step in session.steps():
        with session.update():
            weights += step
        session.report(loss=0.0)
        if step == stop_after:
            return


def test_init_without_relay_is_a_local_session_of_one(tmp_path: Path) -> None:
    session = api.init(total_steps=5, checkpoint_dir=tmp_path)
    assert isinstance(session, LocalSession) and api.current() is session
    assert (session.rank, session.world_size, session.start_step, session.total_steps) == \
        (0, 1, 0, 5)
    assert session.backend == "gloo"
    assert os.environ["WORLD_SIZE"] == "1" and int(os.environ["MASTER_PORT"]) > 0


def test_checkpoints_every_n_and_at_the_end_keeping_two(tmp_path: Path) -> None:
    session = LocalSession(total_steps=7, checkpoint_dir=tmp_path, checkpoint_every=3)
    weights = torch.zeros(2)
    train(session, weights)
    assert [step for step, _ in local_checkpoints(tmp_path)] == [6, 7]
    assert not list(tmp_path.glob("*.partial"))
    again = LocalSession(total_steps=7, checkpoint_dir=tmp_path, checkpoint_every=3)
    assert again.start_step == 7 and list(again.steps()) == []


def test_a_rerun_resumes_from_the_newest_checkpoint_and_ends_the_same(tmp_path: Path) -> None:
    whole = torch.zeros(2)
    train(LocalSession(total_steps=10, checkpoint_dir=tmp_path / "a", checkpoint_every=3), whole)
    crashed = torch.zeros(2)
    folder = tmp_path / "b"
    train(LocalSession(total_steps=10, checkpoint_dir=folder, checkpoint_every=3), crashed,
          stop_after=7)
    resumed = LocalSession(total_steps=10, checkpoint_dir=folder, checkpoint_every=3)
    assert resumed.start_step == 6
    weights = torch.zeros(2)
    train(resumed, weights)
    assert torch.equal(weights, whole) and float(whole[0]) == sum(range(10))


def test_epochs_take_their_length_from_the_loader(tmp_path: Path) -> None:
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4)  # 3 batches
    session = LocalSession(epochs=2, checkpoint_dir=tmp_path)
    seen = [(epoch, index) for epoch, index, _ in session.batches(loader)]
    assert seen == [(e, i) for e in range(2) for i in range(3)]
    assert session.total_steps == 6


def test_total_steps_from_the_environment(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_TOTAL_STEPS", "4")
    monkeypatch.setenv("RELAY_CHECKPOINT_DIR", str(tmp_path / "env"))
    session = LocalSession()
    assert list(session.steps()) == [0, 1, 2, 3]
    assert session.checkpoint_dir == tmp_path / "env"


def test_no_length_says_how_to_give_one(tmp_path: Path) -> None:
    session = LocalSession(checkpoint_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"init\(total_steps=N\).*RELAY_TOTAL_STEPS"):
        list(session.steps())
