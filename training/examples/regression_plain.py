"""A plain torchrun script: a small MLP fitted to a noisy function, with DDP over gloo.

    torchrun --nproc-per-node 2 training/examples/regression_plain.py --steps 200

This is the script as a team writes it before Relay; ``regression.py`` beside it is
the same script with the few lines Relay needs (``diff -u`` the two).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return inputs and targets for ``step`` on ``rank`` (the same for any rerun)."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, 8, generator=gen)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(size, 1, generator=gen)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for step in range(args.steps):
        x, y = batch(step, rank, args.batch_size)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
