"""A plain Hugging Face ``Trainer`` script: a tiny GPT-2 on random tokens, DDP over gloo.

    torchrun --nproc-per-node 2 training/examples/hf_gpt2_plain.py

``hf_gpt2.py`` beside it is the same script under Relay (``diff -u`` the two).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from tiny_gpt2 import RandomTokens, tiny_gpt2
from transformers import Trainer, TrainingArguments, set_seed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    set_seed(0)
    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-gpt2-"), max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, learning_rate=args.lr, use_cpu=True,
        ddp_backend="gloo", ddp_find_unused_parameters=False, save_strategy="no",
        report_to="none", logging_steps=10, disable_tqdm=True, seed=0)
    trainer = Trainer(model=tiny_gpt2(), args=training, train_dataset=RandomTokens(512))
    trainer.train()


if __name__ == "__main__":
    main()
