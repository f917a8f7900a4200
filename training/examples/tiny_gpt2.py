"""A 2-layer GPT-2 built from a config (nothing downloaded) and random token data.

What the Lightning and Trainer examples beside this file train: small enough for
four CPU ranks, a real ``transformers`` model all the same.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 64
LENGTH = 16


def tiny_gpt2() -> GPT2LMHeadModel:
    """Return a freshly initialised 2-layer GPT-2 (28k parameters)."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


class RandomTokens(Dataset):
    """``size`` sequences of random tokens, each a function of its index alone."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        tokens = torch.randint(0, VOCAB, (LENGTH,), generator=gen)
        return {"input_ids": tokens, "labels": tokens}
