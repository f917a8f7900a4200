"""A small but real model: a causal character-level transformer."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the character transformer."""

    vocab_size: int = 128
    context: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.1


class CharTransformer(nn.Module):
    """Embed characters, run causal self-attention blocks, predict the next one."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        layer = nn.TransformerEncoderLayer(
            d_model=cfg.d_model,
            nhead=cfg.n_heads,
            dim_feedforward=4 * cfg.d_model,
            dropout=cfg.dropout,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        mask = torch.triu(torch.full((cfg.context, cfg.context), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return logits ``[batch, time, vocab]`` for token ids ``[batch, time]``."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = self.blocks(x, mask=self.causal_mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def build_model(cfg: ModelConfig, seed: int) -> CharTransformer:
    """Build the model with weights that depend only on ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CharTransformer(cfg)
