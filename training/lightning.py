"""Relay for a PyTorch Lightning script: one callback and the resume path.

A Lightning script written for ``torchrun`` runs under Relay with three changed lines::

    from relay_train.lightning import RelayCallback

    relay = RelayCallback()                      # joins Relay's process group
    trainer = L.Trainer(..., strategy="ddp", max_steps=relay.total_steps, callbacks=[relay])
    trainer.fit(model, loader, ckpt_path=relay.resume_path())

The callback gives Relay heartbeats (step, phase: DDP's gradient all-reduce is
marked through ``session.comm_hook()``), checkpoints the trainer's own
checkpoint dict (model, optimizers, schedulers, loops, callbacks) through the
session to MLflow on the job's schedule and at the segment's end, answers
rescue and drain from it, and stops the trainer at the segment's end or a
drain's stop step. ``resume_path()`` is Relay's verified checkpoint, written
as a Lightning checkpoint file for ``ckpt_path`` (None at step 0).

Lightning uses the process group the callback joined (it skips its own
``init_process_group`` when one exists) and reads the ranks from torchrun's
environment, which Relay's node agent sets; ``devices`` and ``num_nodes`` must
match the spec's ``ranks_per_node`` and ``nodes``.

A resume mid-epoch continues where the checkpoint was, bit for bit: Lightning
itself restarts a plain ``DataLoader``'s epoch (only a stateful loader
continues), and draws a new loader seed from torch's generator when it iterates
the loader. So the callback, before the first resumed batch, makes the
loader's sampler skip the batches the epoch already trained (their samples are
never loaded; :class:`SkipOnce`), and seeds torch's and Python's RNGs before
every step from (job seed, step, rank), so dropout does not depend on the RNG's
history (``RelayCallback(seed_steps=False)`` keeps the script's own stream, and
then a resume is not bit for bit). The skip needs a finite loader with a ``batch_sampler``
over a ``sampler`` (any ``DataLoader`` given ``batch_size``) and
``accumulate_grad_batches=1``; otherwise a warning says the epoch restarts.
Needs ``pip install relay-training[callbacks]``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl
import torch

from relay_train.driven import DrivenCallback, resume_folder

log = logging.getLogger("relay_train")

STATE_KEY = "lightning"  # the trainer's checkpoint dict, in Relay's checkpoint


class RelayCallback(DrivenCallback, pl.Callback):
    """Heartbeats, checkpoints, rescue and drain for a Lightning ``Trainer`` under Relay."""

    framework = "lightning"

    def __init__(self, session: Any = None, *, seed_steps: bool = True) -> None:  # noqa: ANN401
        super().__init__(session, seed_steps=seed_steps)  # Lightning then trains in Relay's group
        self._trainer: pl.Trainer | None = None
        self._resumed = False

    def resume_path(self) -> str | None:
        """Return a Lightning checkpoint file of Relay's resume point, or None at step 0.

        The checkpoint is sha256-verified and loaded with ``weights_only=True`` by the
        session first; this rank writes its own copy on its node.
        """
        state = self.session.resume_state()
        if state is None:
            return None
        self._resumed = True
        path = resume_folder(self.session, f"rank-{self.session.rank}") / \
            f"lightning-step-{state['step']}.ckpt"
        torch.save(state[STATE_KEY], path)
        return str(path)

    # -- Lightning's hooks --------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Mark DDP's all-reduce, name the tracked state, and begin the segment's steps."""
        self._trainer = trainer
        ddp = trainer.strategy.model
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            ddp.register_comm_hook(None, self.session.comm_hook())
        self.session.track(self._state)
        if self._resumed:
            _continue_epoch(trainer)
        if not self._loop.start(trainer.global_step):
            trainer.should_stop = True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:  # noqa: ANN401
        """The step's forward is next: seed its random draws."""
        self._loop.seed()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """Hold the rescue lock across the optimizer step and the step counter."""
        self._loop.before_update()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:  # noqa: ANN401
        """Report the step (heartbeat, checkpoint when due); stop at the segment's end."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        value = float(loss.detach()) if torch.is_tensor(loss) else None
        if not self._loop.step_done(trainer.global_step, loss=value, samples=_size(batch)):
            trainer.should_stop = True

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Publish what is pending and leave Relay's segment (and its process group)."""
        self._loop.close()

    def _state(self) -> dict[str, Any]:
        assert self._trainer is not None
        # What trainer.save_checkpoint writes (no public call returns it without a file).
        return {STATE_KEY: self._trainer._checkpoint_connector.dump_checkpoint(False)}


class SkipOnce:
    """A sampler that leaves out the first ``skip`` indices of its next pass, then is the
    sampler it wraps again (its length stays the whole epoch's, as Lightning counts)."""

    def __init__(self, sampler: Any, skip: int, owner: Any) -> None:  # noqa: ANN401
        self.sampler, self.skip, self.owner = sampler, skip, owner

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        self.owner.sampler = self.sampler  # this pass only
        indices = iter(self.sampler)
        for _ in range(self.skip):
            next(indices, None)
        yield from indices

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on (a ``DistributedSampler`` shuffles by it)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def _continue_epoch(trainer: pl.Trainer) -> None:
    """Make the resumed epoch's loader skip the batches already trained in it."""
    loop = trainer.fit_loop
    batches = trainer.num_training_batches
    done = trainer.global_step % batches if isinstance(batches, int) and batches else 0
    loaders = loop._combined_loader.flattened if loop._combined_loader is not None else []
    if done == 0 or not loaders:
        return  # at an epoch's start: nothing to skip
    batch_samplers = [getattr(dl, "batch_sampler", None) for dl in loaders]
    if trainer.accumulate_grad_batches != 1 or not all(
            hasattr(b, "sampler") and hasattr(b, "batch_size") for b in batch_samplers):
        log.warning("relay_train.lightning: the resumed epoch restarts from its first batch "
                    "(expected accumulate_grad_batches=1 and DataLoaders with a batch_size; "
                    "found %d and %s), so the run is not bit for bit an uninterrupted one",
                    trainer.accumulate_grad_batches, [type(b).__name__ for b in batch_samplers])
        return
    for owner in batch_samplers:
        owner.sampler = SkipOnce(owner.sampler, done * owner.batch_size, owner)  # type: ignore[union-attr]
    iter(loop._data_fetcher)  # a fresh iterator over them (a worker may have prefetched)
    log.info("relay_train.lightning: the resumed epoch goes on from its batch %d", done)


def _size(batch: Any) -> int:  # noqa: ANN401 - whatever the DataLoader yields
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(first, dict):
        first = next(iter(first.values()), None)
    return int(first.shape[0]) if torch.is_tensor(first) and first.dim() > 0 else 0
