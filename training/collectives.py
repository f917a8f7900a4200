"""Collectives outside the gradient hook, marked in the heartbeat as the collective phase.

The comm hook (:mod:`relay_train.reduce`) marks the gradient all-reduce. A step
has other collectives a healthy rank can wait in while a stalled peer holds
everyone up: DDP broadcasts the model's buffers at the start of every forward
(``broadcast_buffers=True``, the default, for any model with a registered
buffer), and FSDP2 (``fully_shard``) all-gathers each module's parameters before
its forward and again in backward, and reduce-scatters its gradients after. A rank
waiting there would still read "compute", and the watcher could not tell it from
the stalled one. :func:`mark_collectives` brackets the forward ones with forward
pre-hooks: one that runs before the framework's (collective), one that runs after
it (compute again). FSDP2's backward ones run in autograd hooks that take no hooks
of their own: the module's FSDP state's pre-backward (all-gather, and its wait),
each parameter group's post-backward (reduce-scatter) and the root's end-of-backward
callback (waiting for the last reduce-scatters) are wrapped on the instance, so
they run as collective and the backward computes again after each. These are
torch 2.13's ``torch.distributed.fsdp._fully_shard`` names; on a torch without
them only the forward is marked (and a warning says so).

Relay's evidence (each rank's stack and collective trace) settles a culprit for
any collective a script runs unmarked.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from relay_train.device import wait_for_compute
from relay_train.protocol.heartbeat import HeartbeatWriter, Phase
from relay_train.reduce import comm_hook

log = logging.getLogger("relay_train.collectives")

# FSDP2's backward collectives: (on the module's FSDPState) the pre-backward hook that
# all-gathers and waits, the root's end-of-backward callback; (on each FSDPParamGroup)
# the post-backward that reduce-scatters.
FSDP_STATE_BACKWARD = ("_pre_backward", "_root_post_backward_final_callback")
FSDP_GROUP_BACKWARD = "post_backward"


class Removable(Protocol):
    """A mark that can be taken off again (a hook's handle, or a wrapped method)."""

    def remove(self) -> None:
        """Take the mark off."""


class Bracket:
    """Enter a collective on the outermost of nested calls, compute on leaving it (FSDP2's
    end-of-backward callback runs post-backwards that did not run in autograd)."""

    def __init__(self, enter_collective: Callable[[], None],
                 enter_compute: Callable[[], None]) -> None:
        self._enter_collective, self._enter_compute = enter_collective, enter_compute
        self._depth = 0

    def enter(self) -> None:
        """A wrapped call starts."""
        self._depth += 1
        if self._depth == 1:
            self._enter_collective()

    def leave(self) -> None:
        """A wrapped call ends."""
        self._depth -= 1
        if self._depth == 0:
            self._enter_compute()


class WrappedMethod:
    """``owner.name`` replaced, on the instance, by one that runs between two calls."""

    def __init__(self, owner: object, name: str, before: Callable[[], None],
                 after: Callable[[], None]) -> None:
        self.owner, self.name = owner, name
        original = getattr(owner, name)

        def marked(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - the method's own
            before()
            try:
                return original(*args, **kwargs)
            finally:
                after()

        setattr(owner, name, marked)

    def remove(self) -> None:
        """Give the instance its class's method back."""
        vars(self.owner).pop(self.name, None)


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


def _mark_fsdp2_backward(module: torch.nn.Module, bracket: Bracket) -> list[Removable]:
    """Wrap ``module``'s FSDP2 backward collectives (see the module's docstring)."""
    state = module._get_fsdp_state()  # type: ignore[operator]  # FSDPModule's
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None or not all(hasattr(state, n) for n in FSDP_STATE_BACKWARD):
        log.warning("FSDP2's backward collectives are not marked: this torch's FSDPState has "
                    "no %s; the stacks still settle a hang there", FSDP_STATE_BACKWARD)
        return []
    owners = [(state, n) for n in FSDP_STATE_BACKWARD]
    owners += [(group, FSDP_GROUP_BACKWARD) for group in groups]
    return [WrappedMethod(o, n, bracket.enter, bracket.leave) for o, n in owners]


def mark_collectives(
    model: torch.nn.Module, enter_collective: Callable[[], None],
    enter_compute: Callable[[], None],
) -> list[Removable]:
    """Bracket ``model``'s collectives outside the gradient hook with ``enter_collective``/
    ``enter_compute``.

    DDP's buffer broadcast (when it runs), each FSDP2 module's pre-forward
    all-gather and its backward collectives. Return the marks (empty: nothing to mark).
    """
    def collective(*_: Any) -> None:  # noqa: ANN401 - hook arguments, unused
        enter_collective()

    def compute(*_: Any) -> None:  # noqa: ANN401
        enter_compute()

    handles: list[Removable] = []
    backward = Bracket(enter_collective, enter_compute)  # one, for all modules' nesting
    if isinstance(model, DistributedDataParallel):
        if _broadcasts_buffers(model):  # DDP.forward: buffer broadcast, then module(...)
            handles.append(model.register_forward_pre_hook(collective))
            handles.append(model.module.register_forward_pre_hook(compute))
        model = model.module
    for module in _fsdp2_modules(model):
        # fully_shard's own pre-forward hook is prepended: ours goes before it, then after.
        handles.append(module.register_forward_pre_hook(collective, prepend=True))
        handles.append(module.register_forward_pre_hook(compute))
        handles += _mark_fsdp2_backward(module, backward)
    return handles


class CollectivePhases:
    """A session's collective-phase marks in the heartbeat (comm hook, model hooks, blocks).

    A mixin of :class:`~relay_train.api.Session`, which sets these attributes.
    """

    _heartbeat: HeartbeatWriter
    _phases: StepPhases
    _clock: dict[str, float]  # this step's marks: "started", "compute_done", "wait_..."
    device: torch.device

    def _mark_wait(self, mark: str) -> None:
        """Note under ``mark`` in this step's clock the training thread's CPU wait as the
        phase just entered began (the heartbeat read it then: no second read)."""
        waited = self._heartbeat.phase_began_waited
        if waited is not None:
            self._clock[mark] = waited

    def comm_hook(self, *, ordered: bool = True) -> Any:  # noqa: ANN401 - DDP's hook type
        """Return a DDP comm hook that marks the collective phase (and sums in rank order).

        ``ordered=True`` makes the gradient sum independent of DDP's bucket
        layout, which bit-exact resume needs; ``False`` uses the backend's
        all-reduce.
        """
        return comm_hook(self.enter_collective, ordered=ordered)

    def mark_collectives(self, model: torch.nn.Module) -> None:
        """Mark the collectives ``model`` runs outside the gradient hook (DDP's buffer
        broadcast, FSDP2's all-gathers and reduce-scatters, forward and backward) in the
        heartbeat: a rank waiting there is not taken for a stalled one."""
        mark_collectives(model, self._phases.wait, self._phases.resume_compute)

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Mark a collective outside DDP (``with session.collective(): dist.all_reduce(t)``);
        the phase is compute again after it."""
        self.enter_collective()
        try:
            yield
        finally:
            self._phases.resume_compute()

    def enter_phase(self, phase: Phase) -> None:
        """Say what this rank is doing, for a loop that Relay does not drive step by step
        (a trainer's own collectives between two steps; see :mod:`relay_train.driven`)."""
        self._heartbeat.enter(phase)

    def enter_collective(self) -> None:
        """Mark the end of this step's local compute (once per step)."""
        first = "compute_done" not in self._clock
        if first:
            wait_for_compute(self.device)  # on CUDA: queued kernels are compute, not collective
            self._clock["compute_done"] = time.perf_counter()
        self._phases.wait()
        if first:
            self._mark_wait("wait_compute_done")
