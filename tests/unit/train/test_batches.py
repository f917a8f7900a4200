"""Relay's step <-> (epoch, batch) mapping, and resuming inside an epoch by sampler index."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from relay_train.batches import epoch_batches, epoch_position, steps_per_epoch

SIZE = 22
SEED = 5


class Counted(Dataset[int]):
    """The integers 0..SIZE-1, counting every item loaded."""

    def __init__(self) -> None:
        self.loaded = 0

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> int:
        self.loaded += 1
        return index


def make_loader(kind: str, drop_last: bool, rank: int = 0) -> DataLoader:
    data = Counted()
    if kind == "distributed":
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=3,
                                     drop_last=drop_last)
        return DataLoader(data, batch_size=4, sampler=sampler, drop_last=drop_last)
    return DataLoader(data, batch_size=4, shuffle=kind == "shuffle", drop_last=drop_last)


def run(loader: DataLoader, start: int, end: int) -> list[tuple[int, int, list[int]]]:
    return [(e, i, b.tolist()) for e, i, b in epoch_batches(loader, range(start, end), seed=SEED)]


@pytest.mark.parametrize(("step", "per_epoch", "expected"), [
    (0, 5, (0, 0)), (4, 5, (0, 4)), (5, 5, (1, 0)), (17, 5, (3, 2)), (7, 1, (7, 0))])
def test_epoch_position(step: int, per_epoch: int, expected: tuple[int, int]) -> None:
    assert epoch_position(step, per_epoch) == expected


def test_epoch_position_needs_a_length() -> None:
    with pytest.raises(ValueError, match="steps_per_epoch > 0"):
        epoch_position(3, 0)


@pytest.mark.parametrize(("kind", "drop_last", "length"), [
    ("sequential", False, 6), ("sequential", True, 5),  # 22 items, batches of 4
    ("distributed", False, 3), ("distributed", True, 2),  # 11 per rank
])
def test_a_step_is_a_batch_drop_last_decides_the_last_one(kind: str, drop_last: bool,
                                                          length: int) -> None:
    loader = make_loader(kind, drop_last)
    assert steps_per_epoch(loader) == length == len(loader)
    batches = run(loader, 0, length)
    assert [index for _, index, _ in batches] == list(range(length))
    last = {"sequential": 2, "distributed": 3}[kind]  # the partial batch, kept or dropped
    assert len(batches[-1][2]) == (4 if drop_last else last)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kind", ["sequential", "shuffle", "distributed"])
def test_resuming_anywhere_yields_the_batches_of_an_uninterrupted_run(kind: str,
                                                                      drop_last: bool) -> None:
    per_epoch = len(make_loader(kind, drop_last))
    total = 3 * per_epoch
    whole = run(make_loader(kind, drop_last), 0, total)
    assert len({tuple(b) for e, _, b in whole if e == 0}) == per_epoch
    for resume in range(total):  # a fresh loader, as a resumed process builds it
        assert run(make_loader(kind, drop_last), resume, total) == whole[resume:], resume


@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_epochs_are_the_plain_set_epoch_loop(drop_last: bool) -> None:
    for rank in (0, 1):
        loader = make_loader("distributed", drop_last, rank)
        plain = []
        for epoch in range(3):
            loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
            plain += [(epoch, i, b.tolist()) for i, b in enumerate(loader)]
        assert run(make_loader("distributed", drop_last, rank), 0, len(plain)) == plain
    shuffled = [b for _, _, b in run(make_loader("distributed", drop_last), 0, 6)]
    assert shuffled[:3] != shuffled[3:6]  # set_epoch reached the sampler: a new order


def test_shuffled_epochs_differ_and_leave_the_global_rng_alone() -> None:
    loader = make_loader("shuffle", drop_last=True)
    before = torch.get_rng_state()
    batches = run(loader, 0, 10)
    assert torch.equal(before, torch.get_rng_state())
    assert [b for e, _, b in batches if e == 0] != [b for e, _, b in batches if e == 1]


def test_resume_skips_by_index_without_loading_the_skipped_items() -> None:
    loader = make_loader("sequential", drop_last=False)
    batches = run(loader, 4, 6)  # batches 4 and 5 of epoch 0
    assert [b for _, _, b in batches] == [[16, 17, 18, 19], [20, 21]]
    assert loader.dataset.loaded == 6  # type: ignore[attr-defined]


def test_unbatched_loader_skips_in_its_sampler() -> None:
    loader = DataLoader(Counted(), batch_size=None)
    assert [int(b) for _, _, b in epoch_batches(loader, range(20, 24), seed=SEED)] == \
        [20, 21, 0, 1]


def test_worker_processes_see_the_same_batches() -> None:
    plain = run(make_loader("shuffle", drop_last=False), 3, 9)
    data = Counted()
    workers = DataLoader(data, batch_size=4, shuffle=True, num_workers=1)
    assert run(workers, 3, 9) == plain


def test_a_loader_the_spec_disagrees_with_is_refused() -> None:
    with pytest.raises(ValueError, match=r"steps_per_epoch is 7, but len\(loader\) is 6"):
        list(epoch_batches(make_loader("sequential", False), range(3), seed=SEED,
                           expected_per_epoch=7))


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(8))

    def __len__(self) -> int:
        return 8


@pytest.mark.parametrize(("start", "ok"), [(0, True), (2, True), (3, False)])
def test_an_iterable_dataset_resumes_at_epoch_starts_only(start: int, ok: bool) -> None:
    loader = DataLoader(Stream(), batch_size=4)  # 2 batches an epoch
    steps: Callable[[], list[Any]] = lambda: run(loader, start, 4)  # noqa: E731
    if ok:
        assert steps()[0][:2] == divmod(start, 2)
    else:
        with pytest.raises(ValueError, match="IterableDataset"):
            steps()
