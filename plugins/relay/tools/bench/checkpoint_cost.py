"""`relay bench checkpoint`: what a checkpoint costs the training loop, sync vs async.

One process, one model, publishing to a real MLflow store (SQLite + local
artifacts in a temp folder). The two modes run in separate blocks, one after the
other, each drained before the next starts, so an async save's background work
never overlaps a sync measurement:

- sync block: the loop waits for snapshot + torch.save + sha256 + MLflow upload;
- async block: the loop waits for the in-memory snapshot only; the rest runs in
  a background thread, beside the next training steps.

Besides the stall per save, the async block times every training step and sorts
it by whether a save was in flight when the step began, so the output shows
how much slower steps run while the background save competes for the CPU
(compared with the async block's steps with no save in flight, and with the
sync block's steps, which never have one).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from mlflow.tracking import MlflowClient

from relay_train.checkpoints.checkpointer import Checkpointer
from relay_train.checkpoints.publish import MlflowCheckpointSink
from relay_train.examples.data import CharStream, load_corpus, mix_seed
from relay_train.examples.transformer import ModelConfig, build_model
from relay_train.protocol.signing import KeyRing


@dataclass
class Block:
    """One mode's block: the stall per save and its training steps' times."""

    stalls: list[float] = field(default_factory=list)
    idle_steps: list[float] = field(default_factory=list)  # no save in flight
    busy_steps: list[float] = field(default_factory=list)  # a save in flight
    published: int = 0


class Trainer:
    """The model, its optimizer and its data, stepping on."""

    def __init__(self, d_model: int, n_layers: int) -> None:
        self.cfg = ModelConfig(d_model=d_model, n_layers=n_layers, n_heads=8, context=64)
        self.model = build_model(self.cfg, seed=1)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.stream = CharStream(load_corpus("builtin:python_docs"), self.cfg.context, 8, seed=1)
        self.step = 0

    def train_step(self) -> float:
        """Run one step; return its seconds."""
        started = time.perf_counter()
        torch.manual_seed(mix_seed(self.stream.seed, self.step))
        x, y = self.stream.batch(self.step, 0)
        loss = torch.nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step += 1
        return time.perf_counter() - started


def run_block(trainer: Trainer, ckpt: Checkpointer, saves: int, steps_between: int) -> Block:
    """Save ``saves`` times, ``steps_between`` steps apart; train on until all are published."""
    block = Block()
    submitted = 0

    def timed_step() -> None:
        busy = len(ckpt.published) < submitted
        (block.busy_steps if busy else block.idle_steps).append(trainer.train_step())

    for _ in range(saves):
        for _ in range(steps_between):
            timed_step()
        stats = ckpt.save(trainer.model, trainer.opt, trainer.step, {"data": {}})
        submitted += 1
        block.stalls.append(stats.stall_seconds)
    while len(ckpt.published) < submitted:  # the backlog drains beside training, as in a run
        timed_step()
    ckpt.close()
    block.published = len(ckpt.published)
    return block


def _ms(values: list[float]) -> str:
    if not values:
        return f"{'-':>26}"
    return (f"{statistics.median(values) * 1000:9.1f} ms [{min(values) * 1000:.0f}-"
            f"{max(values) * 1000:.0f}]").rjust(26)


def main(checkpoints: int = 8, d_model: int = 384, n_layers: int = 6, steps_between: int = 10,
         smoke: bool = False) -> int:
    """Run a sync block, then an async block, and print stalls and step slowdown."""
    if smoke:
        checkpoints, d_model, n_layers, steps_between = 2, 64, 2, 3
    torch.set_num_threads(1)
    trainer = Trainer(d_model, n_layers)
    params = sum(p.numel() for p in trainer.model.parameters())
    trainer.train_step()  # create the optimizer state before measuring
    blocks: dict[str, Block] = {}
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as tmp:
        root = Path(tmp)
        uri = f"sqlite:///{root / 'mlflow.db'}"
        client = MlflowClient(uri)
        exp = client.create_experiment("bench", artifact_location=(root / "artifacts").as_uri())
        size_mb = 0.0
        for mode in ("sync", "async"):
            run_id = client.create_run(exp, run_name=mode).info.run_id
            ckpt = Checkpointer(MlflowCheckpointSink(uri, run_id), root / mode, job="bench",
                                world_size=1, parent=None, keys=KeyRing.generate(),
                                asynchronous=(mode == "async"))
            blocks[mode] = run_block(trainer, ckpt, checkpoints, steps_between)
            size_mb = ckpt.published[-1].size_bytes / 1e6
    sync, asyn = blocks["sync"], blocks["async"]
    print(f"Checkpoint benchmark{' (SMOKE: too small for figures)' if smoke else ''}: "
          f"{params / 1e6:.1f}M parameters, checkpoint {size_mb:.0f} MB, {checkpoints} saves "
          f"{steps_between} steps apart per mode; a sync block, then an async block, each "
          "drained before the next (real MLflow store, 1 thread)")
    print("  Compared: the async save's loop stall with the sync save's (median [min-max])")
    print(f"  {'':34} {'sync':>26} {'async':>26}")
    print(f"  {'loop stall per save':34} {_ms(sync.stalls)} {_ms(asyn.stalls)}")
    print(f"  {'training step, no save in flight':34} {_ms(sync.idle_steps)} "
          f"{_ms(asyn.idle_steps)}")
    print(f"  {'training step, async save in flight':34} {'-':>26} {_ms(asyn.busy_steps)}")
    print(f"  {'published':34} {sync.published:>26} {asyn.published:>26}")
    ratio = statistics.median(asyn.stalls) / statistics.median(sync.stalls)
    print(f"  async stall / sync stall: {ratio:.1%}")
    if asyn.busy_steps and asyn.idle_steps:
        slower = statistics.median(asyn.busy_steps) / statistics.median(asyn.idle_steps) - 1
        print(f"  training steps while an async save is in flight: {slower:+.1%} vs steps with "
              f"none in flight ({len(asyn.busy_steps)} vs {len(asyn.idle_steps)} steps)")
    ok = sync.published == checkpoints == asyn.published
    return 0 if ok else 1
