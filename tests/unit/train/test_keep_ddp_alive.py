"""A rank keeps its DDP modules referenced until it leaves (freeing one can deadlock gloo)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from relay_train import timing


def _bare(cls: type) -> object:
    """An instance without ``__init__`` (a real DDP needs a process group): the scan looks
    at types only."""
    return cls.__new__(cls)


def test_every_ddp_module_and_subclass_is_kept_and_nothing_else() -> None:
    mine = type("MyDdp", (DistributedDataParallel,), {})
    deeper = type("DeeperDdp", (mine,), {})
    kept = [_bare(DistributedDataParallel), _bare(mine), _bare(deeper)]
    plain = torch.nn.Linear(2, 2)
    before = len(timing._KEEP_ALIVE)
    try:
        timing.keep_ddp_alive()
        found = timing._KEEP_ALIVE[before:]
        for module in kept:
            assert any(o is module for o in found), type(module).__name__
        assert not any(o is plain for o in found)
    finally:
        del timing._KEEP_ALIVE[before:]
