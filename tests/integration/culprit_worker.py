"""One rank of the culprit bench (:mod:`culprit_bench`): a tiny model, one rank stalls.

Marks its heartbeat phases as ``relay_train.Session`` does (compute at each step's
start, collective in the gradient hook, and with ``--mark`` the forward
collectives of :func:`relay_train.collectives.mark_collectives`), answers evidence
requests with :class:`relay_train.stacks.EvidenceResponder`, and at ``--stall-step``
the ``--stall`` rank never finishes its step (``chaos_hang_forever``, before the
forward, where Relay's injected hang strikes).

Models: ``ddp_buffers`` (BatchNorm under DDP, default ``broadcast_buffers``),
``fsdp2`` (``fully_shard`` on CPU gloo), ``fsdp2_backward`` (the same, but the rank
stalls in its backward, before the last layer's gradient: its peers wait in FSDP2's
backward all-gather) and ``metric`` (DDP without buffers, and a user
``dist.all_reduce`` of the loss between forward and backward, unmarked).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from relay_train.collectives import StepPhases, mark_collectives
from relay_train.inject import chaos_hang_forever
from relay_train.protocol.heartbeat import HeartbeatWriter
from relay_train.reduce import comm_hook
from relay_train.stacks import EvidenceResponder

STEPS = 10_000  # the parent stops the ranks long before


def build(kind: str) -> nn.Module:
    """Return the model of ``kind``, wrapped for data parallelism."""
    torch.manual_seed(0)
    if kind == "ddp_buffers":
        net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        return nn.parallel.DistributedDataParallel(net)
    if kind == "metric":
        return nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    if kind in ("fsdp2", "fsdp2_backward"):
        from torch.distributed.fsdp import fully_shard

        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        for layer in (net[0], net[2]):
            fully_shard(layer)
        fully_shard(net)
        return net
    raise SystemExit("expected a model kind ddp_buffers, fsdp2, fsdp2_backward or metric; "
                     f"found {kind!r}")


def main() -> None:
    """Train until stopped; the stalled rank stops at its step."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--stall", type=int, required=True)
    parser.add_argument("--stall-step", type=int, default=3)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--mark", action="store_true")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = f"node{rank}"
    beat = HeartbeatWriter(args.dir / "heartbeats", rank, node, 0.1).start()
    EvidenceResponder(args.dir, rank, node, poll_seconds=0.05).start()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    model = build(args.model)
    phases = StepPhases(beat)  # as relay_train.Session keeps them
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model.register_comm_hook(None, comm_hook(phases.wait, ordered=False))
    if args.mark:
        mark_collectives(model, phases.wait, phases.resume_compute)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        phases.compute()
        stall = rank == args.stall and step == args.stall_step
        if stall and args.model != "fsdp2_backward":
            chaos_hang_forever()
        x = torch.randn(4, 8)
        loss = model(x).pow(2).mean()
        if stall:  # in the backward, before any of FSDP2's backward collectives
            loss.register_hook(lambda _: chaos_hang_forever())
        if args.model == "metric":
            metric = loss.detach().clone()
            dist.all_reduce(metric)  # a user's metric, unmarked
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        beat.beat(step=step + 1, loss=float(loss.detach()))


if __name__ == "__main__":
    main()
