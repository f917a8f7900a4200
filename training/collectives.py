"""Collectives outside the gradient hook, marked in the heartbeat as the collective phase.

The comm hook (:mod:`relay_train.reduce`) marks the gradient all-reduce. A step
has other collectives a healthy rank can wait in while a stalled peer holds
everyone up: DDP broadcasts the model's buffers at the start of every forward
(``broadcast_buffers=True``, the default, for any model with a registered
buffer), and FSDP2 (``fully_shard``) all-gathers each module's parameters before
its forward. A rank waiting there would still read "compute", and the watcher
could not tell it from the stalled one. :func:`mark_collectives` brackets them
with forward pre-hooks: one that runs before the framework's (collective), one
that runs after it (compute again).

FSDP2's backward all-gathers and reduce-scatters run in autograd hooks that
cannot be bracketed this way; Relay's evidence (each rank's stack and collective
trace) settles a culprit there, and for any collective a script runs unmarked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from relay_train.protocol.heartbeat import HeartbeatWriter, Phase


class StepPhases:
    """This rank's heartbeat phase within a step: computing, or waiting in a collective."""

    def __init__(self, heartbeat: HeartbeatWriter) -> None:
        self._heartbeat = heartbeat
        self._waiting = False

    def compute(self) -> None:
        """Start a step's compute (its clock restarts even when the phase was compute)."""
        self._waiting = False
        self._heartbeat.enter(Phase.COMPUTE)

    def wait(self) -> None:
        """Enter a collective (no-op while in one: DDP calls its hook once per bucket)."""
        if not self._waiting:
            self._waiting = True
            self._heartbeat.enter(Phase.COLLECTIVE)

    def resume_compute(self) -> None:
        """Leave a collective for more of the step's compute."""
        if self._waiting:
            self.compute()


def _fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Return the modules ``fully_shard`` was applied to (none without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _broadcasts_buffers(ddp: DistributedDataParallel) -> bool:
    """Return whether DDP syncs buffers before each forward (and has any to sync)."""
    syncs = getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", False))
    return bool(syncs) and any(True for _ in ddp.module.buffers())


def mark_collectives(
    model: torch.nn.Module, enter_collective: Callable[[], None],
    enter_compute: Callable[[], None],
) -> list[RemovableHandle]:
    """Bracket ``model``'s forward collectives with ``enter_collective``/``enter_compute``.

    DDP's buffer broadcast (when it runs) and each FSDP2 module's pre-forward
    all-gather. Return the hooks' handles (empty: nothing to mark).
    """
    def collective(*_: Any) -> None:  # noqa: ANN401 - hook arguments, unused
        enter_collective()

    def compute(*_: Any) -> None:  # noqa: ANN401
        enter_compute()

    handles: list[RemovableHandle] = []
    if isinstance(model, DistributedDataParallel):
        if _broadcasts_buffers(model):  # DDP.forward: buffer broadcast, then module(...)
            handles.append(model.register_forward_pre_hook(collective))
            handles.append(model.module.register_forward_pre_hook(compute))
        model = model.module
    for module in _fsdp2_modules(model):
        # fully_shard's own pre-forward hook is prepended: ours goes before it, then after.
        handles.append(module.register_forward_pre_hook(collective, prepend=True))
        handles.append(module.register_forward_pre_hook(compute))
    return handles
