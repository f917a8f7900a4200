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
match the spec's ``ranks_per_node`` and ``nodes``. As with any Lightning
mid-epoch checkpoint, a plain ``DataLoader`` restarts its epoch on resume (a
stateful loader continues). Needs ``pip install relay-training[callbacks]``.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

from relay_train.driven import DrivenCallback, resume_folder

STATE_KEY = "lightning"  # the trainer's checkpoint dict, in Relay's checkpoint


class RelayCallback(DrivenCallback, pl.Callback):
    """Heartbeats, checkpoints, rescue and drain for a Lightning ``Trainer`` under Relay."""

    framework = "lightning"

    def __init__(self, session: Any = None) -> None:  # noqa: ANN401 - relay_train.Session
        super().__init__(session)  # Lightning then trains in Relay's process group
        self._trainer: pl.Trainer | None = None

    def resume_path(self) -> str | None:
        """Return a Lightning checkpoint file of Relay's resume point, or None at step 0.

        The checkpoint is sha256-verified and loaded with ``weights_only=True`` by the
        session first; this rank writes its own copy on its node.
        """
        state = self.session.resume_state()
        if state is None:
            return None
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
        if not self._loop.start(trainer.global_step):
            trainer.should_stop = True

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


def _size(batch: Any) -> int:  # noqa: ANN401 - whatever the DataLoader yields
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(first, dict):
        first = next(iter(first.values()), None)
    return int(first.shape[0]) if torch.is_tensor(first) and first.dim() > 0 else 0
