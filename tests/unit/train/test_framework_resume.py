"""What makes a Lightning or Trainer resume continue bit for bit: the resumed epoch's
loader skips what it trained, and each step's draws are seeded from the step."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

pl = pytest.importorskip("pytorch_lightning")
pytest.importorskip("transformers")

from relay_train.lightning import SkipOnce  # noqa: E402


def test_the_resumed_pass_skips_its_trained_batches_once() -> None:
    sampler = DistributedSampler(range(64), num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = DataLoader(list(range(64)), batch_size=4, sampler=sampler)
    batches = loader.batch_sampler
    assert isinstance(batches, BatchSampler)
    sampler.set_epoch(2)
    whole = [b.tolist() for b in loader]
    batches.sampler = SkipOnce(batches.sampler, 3 * 4, batches)
    assert len(loader) == len(whole) == 8  # Lightning's count of the epoch is unchanged
    batches.sampler.set_epoch(2)  # as Lightning sets it, through the wrapper
    assert [b.tolist() for b in loader] == whole[3:]
    assert batches.sampler is sampler  # the next epoch is a whole one
    sampler.set_epoch(3)
    assert len([b.tolist() for b in loader]) == 8


class _Session:
    seed, rank = 7, 2


def test_each_step_draws_the_same_whatever_came_before() -> None:
    from relay_train.driven import DrivenLoop

    loop = DrivenLoop(_Session(), "test")
    loop._step = 12
    torch.rand(5)  # some history: a loader's seed, another rank's states after a rescue
    loop.seed()
    first = torch.rand(3)
    torch.manual_seed(99)
    loop.seed()
    assert torch.equal(torch.rand(3), first)
    loop._step = 13
    loop.seed()
    assert not torch.equal(torch.rand(3), first)
    off = DrivenLoop(_Session(), "test", seed_steps=False)
    off._step = 12
    torch.manual_seed(99)
    off.seed()
    assert not torch.equal(torch.rand(3), first)
