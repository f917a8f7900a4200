"""The Lightning script ``lightning_gpt2_plain.py`` with the lines Relay needs, and no others.

Run by a job spec with ``entrypoint: {script: .../lightning_gpt2.py, args: [--devices, ...]}``.
Relay decides the steps (the spec's ``total_steps``, segment bounds, resume point), so
``--steps`` is gone.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytorch_lightning as pl
import torch
from tiny_gpt2 import RandomTokens, tiny_gpt2
from torch.utils.data import DataLoader

from relay_train.lightning import RelayCallback


class LitGPT(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.model = tiny_gpt2()
        self.lr = lr

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    relay = RelayCallback()
    torch.set_num_threads(1)
    pl.seed_everything(0)
    loader = DataLoader(RandomTokens(512), batch_size=args.batch_size, shuffle=True)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.nodes,
                         strategy="ddp", max_steps=relay.total_steps, callbacks=[relay],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(LitGPT(args.lr), loader, ckpt_path=relay.resume_path())


if __name__ == "__main__":
    main()
