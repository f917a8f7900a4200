"""The torchrun script ``regression_plain.py`` with the lines Relay needs, and no others.

Run by a job spec with ``entrypoint: {script: .../regression.py}``. Relay decides
the steps (segment bounds, resume point), so ``--steps`` is gone.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import relay_train


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return inputs and targets for ``step`` on ``rank`` (the same for any rerun)."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, 8, generator=gen)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(size, 1, generator=gen)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    session = relay_train.init()
    torch.set_num_threads(1)
    dist.init_process_group(session.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, session.comm_hook())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    session.track(lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    if (state := session.resume_state()) is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    for step in session.steps():
        x, y = batch(step, rank, args.batch_size)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        with session.update(step):
            optimizer.step()
        session.report(step, loss=loss.item(), samples=args.batch_size)
        if rank == 0 and step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    session.close()


if __name__ == "__main__":
    main()
