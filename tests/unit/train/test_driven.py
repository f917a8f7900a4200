"""relay_train.driven: the session's loop advanced from a framework's hooks."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

from relay_train.driven import DrivenLoop, mark_collective_on_grads
from relay_train.protocol.heartbeat import Phase


class FakeSession:
    """The parts of a Session the driven loop uses, recording what it was told."""

    def __init__(self, start: int, end: int) -> None:
        self.start_step, self.end = start, end
        self.lock = threading.Lock()
        self.completed = start
        self.reported: list[int] = []
        self.collectives = 0
        self.phases: list[Phase] = []
        self.closed = False

    def steps(self) -> Iterator[int]:
        yield from range(self.start_step, self.end)

    @contextlib.contextmanager
    def update(self, step: int) -> Iterator[None]:
        with self.lock:
            yield
            self.completed = step + 1

    def report(self, step: int, *, loss: float | None = None, samples: int = 0) -> None:
        assert not self.lock.locked(), "reported while holding the rescue lock"
        self.reported.append(step)

    def enter_collective(self) -> None:
        self.collectives += 1

    def enter_phase(self, phase: Phase) -> None:
        self.phases.append(phase)

    def close(self) -> None:
        self.closed = True


def test_the_hooks_train_the_segments_steps_and_stop_at_its_end() -> None:
    session = FakeSession(10, 13)
    loop = DrivenLoop(session, "test")
    assert loop.start(10)
    trained = []
    while True:
        trained.append(loop.step)
        loop.before_update()
        assert session.lock.locked()  # a rescue waits for the optimizer step and the counter
        if not loop.step_done(trained[-1] + 1, loss=1.0, samples=4):
            break
    assert trained == [10, 11, 12] and session.reported == [10, 11, 12]
    assert session.completed == 13 and loop.step is None
    loop.close()
    assert session.closed


def test_a_segment_already_at_its_end_stops_before_any_step() -> None:
    assert not DrivenLoop(FakeSession(20, 20), "test").start(20)


@pytest.mark.parametrize(("start", "done"), [(3, None), (0, 5)])
def test_a_trainer_off_relays_steps_is_an_error_that_says_what_to_do(
    start: int, done: int | None
) -> None:
    loop = DrivenLoop(FakeSession(0, 10), "lightning")
    with pytest.raises(RuntimeError, match="expected step .*Resume from Relay's checkpoint"):
        assert loop.start(start)
        loop.step_done(done)


def test_close_releases_a_lock_a_failed_step_held() -> None:
    session = FakeSession(0, 5)
    loop = DrivenLoop(session, "test")
    loop.start(0)
    loop.before_update()
    loop.close()
    assert not session.lock.locked() and session.closed


def test_the_first_gradient_of_a_step_marks_the_collective() -> None:
    session = FakeSession(0, 1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    handles = mark_collective_on_grads(model, session)
    model(torch.ones(1, 3)).sum().backward()
    assert session.collectives == 4  # one per parameter; the session keeps the first
    for handle in handles:
        handle.remove()


def test_the_trainers_work_between_steps_is_collective_and_its_step_compute() -> None:
    session = FakeSession(0, 1)
    loop = DrivenLoop(session, "hf")
    loop.start(0)
    loop.between_steps()  # e.g. the Trainer's all_gather of token counts: peers wait there
    loop.step_begins()
    loop.step_done(1)  # the segment's end: nothing to mark any more
    loop.between_steps()
    assert session.phases == [Phase.COLLECTIVE, Phase.COMPUTE]
