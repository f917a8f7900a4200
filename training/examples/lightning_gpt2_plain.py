"""A plain PyTorch Lightning script: a tiny GPT-2 on random tokens, DDP over gloo.

    torchrun --nproc-per-node 2 training/examples/lightning_gpt2_plain.py --devices 2

``lightning_gpt2.py`` beside it is the same script under Relay (``diff -u`` the two).
"""

from __future__ import annotations

import argparse
from typing import Any

import pytorch_lightning as pl
import torch
from tiny_gpt2 import RandomTokens, tiny_gpt2
from torch.utils.data import DataLoader


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
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0)
    loader = DataLoader(RandomTokens(512), batch_size=args.batch_size, shuffle=True)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.nodes,
                         strategy="ddp", max_steps=args.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(LitGPT(args.lr), loader)


if __name__ == "__main__":
    main()
