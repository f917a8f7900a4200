"""A plain torchrun script: an epoch loop over a DataLoader with a DistributedSampler.

    torchrun --nproc-per-node 2 training/examples/epochs_plain.py --epochs 4

A small classifier on a fixed synthetic data set, DDP over gloo. This is the script as
a team writes it before Relay; ``epochs.py`` beside it is the same script with the
lines Relay needs, and it also runs without Relay (``diff -u`` the two).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def dataset(size: int = 960) -> TensorDataset:
    """Return a fixed data set: points in 8 dimensions, labelled by a noisy plane."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, 8, generator=gen)
    y = (x @ torch.linspace(-1, 1, 8) + 0.3 * torch.randn(size, generator=gen) > 0).long()
    return TensorDataset(x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch_index, (x, y) in enumerate(loader):
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and batch_index == 0:
                print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
