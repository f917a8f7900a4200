"""A deterministic character stream: every batch is a function of (seed, step, rank).

Nothing here carries hidden state, so a run resumed at step ``s`` reads exactly
the batches an uninterrupted run reads from step ``s`` on; the checkpoint's
data position is simply the step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import torch

BUILTIN_PREFIX = "builtin:"
BUILTIN_NAME = re.compile(r"[A-Za-z0-9_-]+")
VOCAB_SIZE = 128  # 7-bit ASCII; the corpus is filtered to it


def mix_seed(*parts: int) -> int:
    """Combine integers into one 63-bit seed (SplitMix64-style, stable across runs)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


@lru_cache(maxsize=4)
def load_corpus(source: str) -> torch.Tensor:
    """Return the corpus as a 1-D uint8 tensor of ASCII codes."""
    if source.startswith(BUILTIN_PREFIX):
        name = source.removeprefix(BUILTIN_PREFIX)
        if not BUILTIN_NAME.fullmatch(name):  # never a path out of the corpus folder
            raise ValueError(f"corpus {source!r}: expected builtin:<name> of letters, digits, "
                             "'_' or '-', e.g. builtin:python_docs")
        text = resources.files("relay_train").joinpath(f"corpus/{name}.txt").read_text()
    else:
        text = Path(source).read_text(errors="replace")
    codes = text.encode("ascii", "replace")  # every code < VOCAB_SIZE: non-ASCII became "?"
    return torch.frombuffer(bytearray(codes), dtype=torch.uint8).clone()


@dataclass(frozen=True)
class CharStream:
    """Random windows of a corpus, drawn from a generator seeded per (seed, step, rank)."""

    corpus: torch.Tensor
    context: int
    batch_size: int
    seed: int

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (inputs, targets), each ``[batch_size, context]`` int64."""
        # torch.Generator keeps only 32 bits of a seed, so distinct (step, rank)
        # pairs could collide; hashing each window's start keeps all 63 bits.
        high = self.corpus.numel() - self.context - 1
        starts = torch.tensor(
            [mix_seed(self.seed, 0xDA7A, step, rank, i) % high for i in range(self.batch_size)]
        )
        offsets = torch.arange(self.context + 1)
        windows = self.corpus[starts[:, None] + offsets[None, :]].long()
        return windows[:, :-1], windows[:, 1:]
