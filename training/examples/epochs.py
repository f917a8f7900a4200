"""The torchrun script ``epochs_plain.py`` with the lines Relay needs, and no others.

Under Relay (a job spec with ``entrypoint: {script: .../epochs.py}`` and
``epochs``/``steps_per_epoch``) the spec decides the steps; without Relay, as one
plain process or under ``torchrun``, ``--epochs`` does, and checkpoints go to
``./checkpoints`` (a rerun resumes from the newest).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import relay_train


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
    session = relay_train.init(epochs=args.epochs)
    torch.set_num_threads(1)
    session.init_process_group()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, session.comm_hook())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    session.track(lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    if (state := session.resume_state()) is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    for epoch, batch_index, (x, y) in session.batches(loader):
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        with session.update():
            optimizer.step()
        session.report(loss=loss.item(), samples=args.batch_size)
        if rank == 0 and batch_index == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
    session.close()


if __name__ == "__main__":
    main()
