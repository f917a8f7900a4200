"""A :class:`~relay_train.api.Session` driven from a framework's hooks instead of a ``for`` loop.

PyTorch Lightning and Hugging Face ``Trainer`` own their training loop; their
callbacks (:mod:`relay_train.lightning`, :mod:`relay_train.hf`) call this one
object at three points of every step, and it does what ``session.steps()``,
``session.update(step)`` and ``session.report(step)`` do in a plain loop:

    start(step)        the loop begins (the framework's resumed step); False: stop at once
    seed()             the step's forward is next: seed the RNGs from (seed, step, rank)
    before_update()    the optimizer step is next: hold the rescue lock
    step_done(step)    the step and its counter moved: heartbeat, checkpoint when due,
                       then the checks of the next step (segment end, drain, chaos);
                       False: stop before the next step

The session's own generator does the work, one ``next()`` per step, so the
segment's end, a drain's stop, adoption at a boundary and the injected faults
behave exactly as in a plain loop. Imports torch and the standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relay_train.protocol.env import ENV_NODE
from relay_train.protocol.heartbeat import Phase

log = logging.getLogger("relay_train")


def joined(session: Any) -> Any:  # noqa: ANN401 - relay_train.Session
    """Return this rank's session (made if None) after joining Relay's process group.

    Lightning and Accelerate skip their own ``init_process_group`` when a group exists,
    so they train in this one (the spec's backend and collective timeout).
    """
    if session is None:
        import relay_train

        session = relay_train.init()
    if not dist.is_initialized():
        session.init_process_group()
    return session


class DrivenCallback:
    """What both framework callbacks start with: the session, its group and its loop."""

    framework: str  # the trainer's name, for the loop's logs

    def __init__(self, session: Any = None, *, seed_steps: bool = True) -> None:  # noqa: ANN401
        self.session = joined(session)  # the trainer then trains in Relay's process group
        self._loop = DrivenLoop(self.session, self.framework, seed_steps=seed_steps)

    @property
    def total_steps(self) -> int:
        """Return the job's steps: the ``max_steps`` the trainer should have."""
        return int(self.session.total_steps)


def resume_folder(session: Any, name: str) -> Path:  # noqa: ANN401 - relay_train.Session
    """Return a folder of this rank's, on its node, for the trainer's copy of a resume point."""
    folder = Path(session.cfg.root) / "resume" / os.environ.get(ENV_NODE, "node") / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class DrivenLoop:
    """The session's steps, advanced one hook call at a time."""

    def __init__(self, session: Any, framework: str, *,  # noqa: ANN401 - api.Session
                 seed_steps: bool = True) -> None:
        self.session = session
        self.framework = framework
        self.seed_steps = seed_steps
        self._steps: Iterator[int] | None = None
        self._step: int | None = None  # the step being trained, None once the loop ended
        self._update: contextlib.AbstractContextManager[None] | None = None

    @property
    def step(self) -> int | None:
        """Return the step being trained (None before the start and after the end)."""
        return self._step

    def start(self, framework_step: int) -> bool:
        """Begin at the framework's step (after its resume); return False to stop at once."""
        self._expect(framework_step, self.session.start_step, "starts")
        self._steps = self.session.steps()
        return self._advance()

    def seed(self) -> None:
        """Seed torch's and Python's RNGs from (the job's seed, the step, the rank), as
        ``relay_train.seed_step`` does, before the step's forward.

        Dropout then draws the same masks whatever came before: after a rescue (whose
        state holds one healthy rank's random states, taken mid-step), and after the
        framework's own draws on a resume (a ``DataLoader`` takes a seed from torch's
        generator each time it is iterated). Off with ``seed_steps=False``.
        """
        if self.seed_steps and self._step is not None:
            import relay_train  # its API, as joined() takes init() (no cycle through api)

            relay_train.seed_step(self.session.seed, self._step, self.session.rank)

    def before_update(self) -> None:
        """Hold the rescue lock until :meth:`step_done` (the optimizer step is next)."""
        if self._step is None or self._update is not None:
            return
        self._update = self.session.update(self._step)
        self._update.__enter__()

    def step_done(self, framework_step: int, *, loss: float | None = None,
                  samples: int = 0) -> bool:
        """Report the finished step; return False when the loop must stop before the next."""
        step = self._step
        if step is None:
            return False
        self._release()
        self._expect(framework_step, step + 1, "reached")
        self.session.report(step, loss=loss, samples=samples)
        return self._advance()

    def between_steps(self) -> None:
        """Mark the trainer's work before its next step's compute as collective.

        The ``Trainer`` gathers every rank's token count before a step's forward pass
        (``average_tokens_across_devices``) and its logged loss after one: ranks waiting
        there for a stalled peer must not look like computing ones. A stall in Relay's
        own checks (an injected hang) happens before this, in the compute phase.
        """
        if self._step is not None:
            self.session.enter_phase(Phase.COLLECTIVE)

    def step_begins(self) -> None:
        """Mark the step's own compute (after :meth:`between_steps`)."""
        if self._step is not None:
            self.session.enter_phase(Phase.COMPUTE)

    def close(self) -> None:
        """Release the lock if a step failed while holding it; close the session."""
        self._release()
        self._step = None
        self.session.close()

    def _advance(self) -> bool:
        assert self._steps is not None
        try:
            self._step = next(self._steps)
        except StopIteration:
            self._step = None
            return False
        return True

    def _release(self) -> None:
        update, self._update = self._update, None
        if update is not None:
            update.__exit__(None, None, None)

    def _expect(self, found: int, expected: int, what: str) -> None:
        if found != expected:
            raise RuntimeError(
                f"relay_train.{self.framework}: the trainer {what} step {found}; expected step "
                f"{expected} (Relay's segment starts at {self.session.start_step}). Resume "
                "from Relay's checkpoint (pass the callback's resume path to the trainer) and "
                "let the callback alone stop the loop.")


def mark_collective_on_grads(module: torch.nn.Module, session: Any) -> list[Any]:  # noqa: ANN401
    """Mark the collective phase when the first gradient of a step is ready.

    For a DDP wrapper Relay cannot reach to register ``session.comm_hook()``: DDP's
    reducer starts the gradient all-reduce from the same autograd hooks, so a rank
    whose gradients are coming is leaving its compute. Returns the hook handles.
    """
    return [param.register_post_accumulate_grad_hook(lambda _p: session.enter_collective())
            for param in module.parameters() if param.requires_grad]
