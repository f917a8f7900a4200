"""Per-rank RNG states: captured, gathered at rank 0, restored for each rank; tracked objects."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy
import pytest
import torch

from relay_train import rng
from relay_train.checkpoints.checkpointer import restore_rng, snapshot_state
from relay_train.protocol.launch import ResumeFrom
from relay_train.protocol.manifest import file_sha256
from relay_train.session_state import SessionState
from relay_train.timing import StartupClock


def seed_all(value: int, generator: torch.Generator) -> None:
    torch.manual_seed(value)
    random.seed(value)
    numpy.random.seed(value)
    generator.manual_seed(value)


def draws(generator: torch.Generator) -> tuple[Any, ...]:
    return (torch.rand(3).tolist(), random.random(), numpy.random.rand(2).tolist(),
            torch.rand(2, generator=generator).tolist())


def test_each_rank_resumes_with_its_own_states() -> None:
    generator = torch.Generator()
    with torch.random.fork_rng(devices=[]):
        saved, expected = {}, {}
        for rank in (0, 1):  # two ranks, simulated one after the other in this process
            seed_all(100 + rank, generator)
            draws(generator)  # each rank has trained a while
            saved[str(rank)] = rng.capture(generator)
            expected[rank] = draws(generator)
        state = snapshot_state({}, 20, {**saved["0"], "ranks": saved})
        for rank in (1, 0):
            seed_all(999, generator)
            assert restore_rng(state, rank, generator) is True
            assert draws(generator) == expected[rank]


def test_a_rank_without_its_own_states_falls_back_to_the_saving_ranks() -> None:
    generator = torch.Generator()
    with torch.random.fork_rng(devices=[]):
        seed_all(5, generator)
        saved = rng.capture(generator)
        expected = draws(generator)
        seed_all(6, generator)
        # an older checkpoint ({"torch", "python"} only) or a rescued one ("ranks": {})
        assert restore_rng({"rng": {**saved, "ranks": {}}}, 3, generator) is False
        assert draws(generator) == expected


def test_cuda_states_are_saved_and_restored_when_cuda_is_available(
        monkeypatch: pytest.MonkeyPatch) -> None:
    devices = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3], dtype=torch.uint8)]
    restored: list[list[torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: devices)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    state = rng.capture()
    assert state["cuda"] is devices
    with torch.random.fork_rng(devices=[]):
        rng.restore(state)
    assert restored == [devices]


def test_without_numpy_the_other_states_still_round_trip(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rng, "_numpy", lambda: None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        state = rng.capture()
        expected = torch.rand(2)
        rng.restore(state)
        assert "numpy" not in state and torch.equal(torch.rand(2), expected)


class FakeStore:
    """The process group's store, as far as RankStates uses it."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def wait(self, keys: list[str], timeout: object) -> None:
        if not all(k in self.values for k in keys):
            raise RuntimeError("Wait timeout")

    def get(self, key: str) -> bytes:
        return self.values[key]

    def delete_key(self, key: str) -> bool:
        return self.values.pop(key, None) is not None


def test_rank_zero_gathers_every_ranks_states_and_stops_waiting_for_a_silent_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    store = FakeStore()
    monkeypatch.setattr(rng, "_store", lambda: store)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        rank1 = rng.capture()
    rng.RankStates(1, 3).post(40, rank1)
    gather = rng.RankStates(0, 3, timeout_seconds=0.01)
    with caplog.at_level(logging.WARNING, logger="relay_train.rng"):
        states = gather.collect(40, {"torch": torch.get_rng_state()})
        again = gather.collect(60, {"torch": torch.get_rng_state()})
    assert set(states) == {"0", "1"}  # rank 2 never posted: it resumes with rank 0's
    assert torch.equal(states["1"]["torch"], rank1["torch"])
    assert states["1"]["python"] == rank1["python"]
    assert store.values == {}  # read keys are deleted
    assert set(again) == {"0"} and gather.silent == {1, 2}
    warned = [r for r in caplog.records if "rank 2's RNG" in r.getMessage()]
    assert len(warned) == 1  # said once, not at every checkpoint


class FakeSession(SessionState):
    """The state half of a Session, resuming from a local file."""

    def __init__(self, rank: int, resume: ResumeFrom | None) -> None:
        self.cfg = SimpleNamespace(resume=resume, seed=7)  # type: ignore[assignment]
        self.rank = rank
        self.start_step = 20
        self.startup = StartupClock()
        self._state_fn = None
        self._objects = {}
        self._data_generator = None

    def _fetched_resume(self) -> ResumeFrom:
        assert self.cfg.resume is not None
        return self.cfg.resume


def scheduler_and_model() -> tuple[torch.nn.Module, Any]:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def test_named_objects_are_checkpointed_and_loaded_back(tmp_path: Path) -> None:
    model, scheduler = scheduler_and_model()
    for _ in range(3):
        scheduler.optimizer.step()
        scheduler.step()
    writer = FakeSession(0, None)
    writer.track(lambda: {"model": model.state_dict()}, scheduler=scheduler)
    path = tmp_path / "checkpoint.pt"
    torch.save(snapshot_state(writer._tracked(), 20), path)

    fresh_model, fresh_scheduler = scheduler_and_model()
    reader = FakeSession(1, ResumeFrom(str(path), file_sha256(path), "run", 20))
    reader.track(scheduler=fresh_scheduler)
    with torch.random.fork_rng(devices=[]):
        state = reader.resume_state()
    assert state is not None and fresh_scheduler.last_epoch == 3
    assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    assert torch.equal(state["model"]["weight"], model.weight)


def test_track_refuses_what_cannot_be_restored() -> None:
    session = FakeSession(0, None)
    with pytest.raises(TypeError, match=r"track\(lr=...\).*state_dict\(\) and load_state_dict"):
        session.track(lr=0.1)
    with pytest.raises(ValueError, match="Relay's checkpoint keys"):
        session.track(rng=scheduler_and_model()[1])
    session.track(lambda: {"scheduler": {}}, scheduler=scheduler_and_model()[1])
    with pytest.raises(ValueError, match=r"\['scheduler'\] are both"):
        session._tracked()


def test_the_data_generator_is_per_rank_and_resumes(tmp_path: Path) -> None:
    first, other = FakeSession(0, None), FakeSession(1, None)
    assert not torch.equal(torch.rand(4, generator=first.data_generator()),
                           torch.rand(4, generator=other.data_generator()))
    path = tmp_path / "checkpoint.pt"
    own = rng.capture(other.data_generator())
    torch.save(snapshot_state({}, 20, {**own, "ranks": {"1": own}}), path)
    expected = torch.rand(4, generator=other.data_generator())
    resumed = FakeSession(1, ResumeFrom(str(path), file_sha256(path), "run", 20))
    with torch.random.fork_rng(devices=[]):
        resumed.data_generator()  # made before resume_state, as a DataLoader would be
        resumed.resume_state()
    assert torch.equal(torch.rand(4, generator=resumed.data_generator()), expected)
