"""Relay for a Hugging Face ``Trainer`` script: one callback and the resume folder.

A ``Trainer`` script written for ``torchrun`` runs under Relay with three changed lines::

    from relay_train.hf import RelayCallback

    relay = RelayCallback()              # first: joins Relay's process group
    args = TrainingArguments(..., max_steps=relay.total_steps)
    Trainer(..., callbacks=[relay]).train(resume_from_checkpoint=relay.resume_path())

The callback gives Relay heartbeats (step and phase: the collective phase starts
when the first gradient of a step is ready, where DDP's all-reduce starts),
checkpoints the model, optimizer, scheduler and ``TrainerState`` through the
session to MLflow on the job's schedule and at the segment's end, answers
rescue and drain from them, and stops the trainer at the segment's end or a
drain's stop step. ``resume_path()`` is Relay's verified checkpoint written as
a ``Trainer`` checkpoint folder (None at step 0); the trainer skips the batches
already trained in the epoch. The callback seeds torch's and Python's RNGs
before every step from (job seed, step, rank) (``seed_steps=False``: the
script's own stream), so dropout does not depend on the RNG's history: after a
rescue the saved random states are one healthy rank's, taken mid-step.

``TrainingArguments`` reads the ranks from torchrun's environment, which Relay's
node agent sets, and Accelerate uses the process group the callback joined.
The trainer keeps its DDP wrapper to itself; the callback finds it (the one
wrapping the model it is given) and registers Relay's rank-ordered comm hook, so
the gradient sum does not depend on DDP's bucket layout, which changes after the
first step of every attempt. Needs ``pip install relay-training[callbacks]``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.utils import WEIGHTS_NAME

from relay_train.driven import DrivenCallback, mark_collective_on_grads, resume_folder

log = logging.getLogger("relay_train")


class RelayCallback(DrivenCallback, TrainerCallback):
    """Heartbeats, checkpoints, rescue and drain for a ``Trainer`` under Relay."""

    framework = "hf"

    def __init__(self, session: Any = None, *, seed_steps: bool = True) -> None:  # noqa: ANN401
        super().__init__(session, seed_steps=seed_steps)  # Accelerate trains in Relay's group
        self._objects: dict[str, Any] = {}
        self._loss: float | None = None

    def resume_path(self) -> str | None:
        """Return a ``Trainer`` checkpoint folder of Relay's resume point, or None at step 0.

        The checkpoint is sha256-verified and loaded with ``weights_only=True`` by the
        session first; this rank writes its own folder on its node.
        """
        state = self.session.resume_state()
        if state is None:
            return None
        folder = resume_folder(self.session, f"rank-{self.session.rank}/hf-step-{state['step']}")
        torch.save(state["model"], folder / WEIGHTS_NAME)
        torch.save(state["optimizer"], folder / OPTIMIZER_NAME)
        torch.save(state["scheduler"], folder / SCHEDULER_NAME)
        (folder / TRAINER_STATE_NAME).write_text(state["trainer_state"])
        return str(folder)

    # -- the Trainer's events -----------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:  # noqa: ANN401
        """Mark the collective phase, name the tracked state, begin the segment's steps."""
        model = kwargs["model"]
        self._objects = {"model": model, "optimizer": kwargs["optimizer"],
                         "scheduler": kwargs["lr_scheduler"], "state": state}
        mark_collective_on_grads(model, self.session)
        ddp = _ddp_of(model)
        if ddp is not None:  # before the first backward, as DDP requires
            ddp.register_comm_hook(None, self.session.comm_hook())
        else:
            log.warning("relay_train.hf: found no DistributedDataParallel around the model; "
                        "the gradient sum is the backend's, so a resumed run is close to, not "
                        "bit for bit, an uninterrupted one")
        self.session.track(self._state)
        if not self._loop.start(state.global_step):
            control.should_training_stop = True
        self._loop.between_steps()

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                              control: TrainerControl, **kwargs: Any) -> None:  # noqa: ANN401
        """Hold the rescue lock across the optimizer step and the step counter."""
        self._loop.before_update()

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:  # noqa: ANN401
        """Report the step (heartbeat, checkpoint when due); stop at the segment's end."""
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        loss, self._loss = self._loss, None
        if not self._loop.step_done(state.global_step, loss=loss, samples=samples):
            control.should_training_stop = True
        self._loop.between_steps()  # the trainer's loss and token-count gathers come next

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:  # noqa: ANN401
        """The step's forward pass is next: the rank computes, its draws seeded."""
        self._loop.step_begins()
        self._loop.seed()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:  # noqa: ANN401
        """Keep the logged loss for the next heartbeat (``logging_steps`` sets how often)."""
        if logs and "loss" in logs:
            self._loss = float(logs["loss"])

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:  # noqa: ANN401
        """Publish what is pending and leave Relay's segment (and its process group)."""
        self._loop.close()

    def _state(self) -> dict[str, Any]:
        objects = self._objects
        return {"model": objects["model"].state_dict(),
                "optimizer": objects["optimizer"].state_dict(),
                "scheduler": objects["scheduler"].state_dict(),
                "trainer_state": json.dumps(dataclasses.asdict(objects["state"]))}


def _ddp_of(model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """Return the DDP wrapper around ``model`` (the trainer's ``model_wrapped``), if any."""
    ddp_type = torch.nn.parallel.DistributedDataParallel
    return next((obj for obj in gc.get_objects()
                 if isinstance(obj, ddp_type) and obj.module is model), None)
