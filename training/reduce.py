"""Gradient reduction for DDP: a comm hook that tells Relay when compute ended.

The hook is the moment a rank finished its local work for the step: it flips
the rank's heartbeat to the collective phase, so that a rank that never gets
there (stalled in compute) is the one blamed for a hang. Optionally it also
sums the ranks in rank order, which makes resumed runs bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def ordered_allreduce(buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Average ``buf`` over all ranks, summing in rank order; return a future of the result.

    gloo's ring all-reduce adds ranks in an order that depends on where an
    element sits in the bucket, and DDP rebuilds buckets after the first step,
    so a resumed run could differ in the last bit. All-gather, then a sum in
    rank order, is the same for every layout.
    """
    world = dist.get_world_size()
    parts = [torch.empty_like(buf) for _ in range(world)]
    fut = dist.all_gather(parts, buf, async_op=True).get_future()

    def reduce(done: torch.futures.Future[Any]) -> torch.Tensor:
        done.value()  # re-raise a failed all-gather; never sum uninitialised buffers
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.div_(world)

    return fut.then(reduce)


def plain_allreduce(buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Average ``buf`` over all ranks with the backend's own all-reduce."""
    world = dist.get_world_size()
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda done: done.value()[0].div_(world))


def comm_hook(on_collective: Callable[[], None], *, ordered: bool) -> Any:  # noqa: ANN401
    """Return a DDP comm hook that calls ``on_collective`` once per step, then reduces.

    ``on_collective`` must be cheap and idempotent within a step (DDP calls the
    hook once per bucket).
    """
    reduce_fn = ordered_allreduce if ordered else plain_allreduce

    # DDP inspects the hook's annotations at runtime, and with postponed
    # evaluation they are strings it rejects; so this one stays unannotated.
    def hook(_state, bucket):  # noqa: ANN001, ANN202
        on_collective()
        return reduce_fn(bucket.buffer())

    return hook
