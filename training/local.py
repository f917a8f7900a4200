"""The session a script gets outside Relay: the same calls, a local folder, no Relay.

``relay_train.init()`` without Relay's environment (``RELAY_LAUNCH``) returns a
:class:`LocalSession`, so one script runs as one plain process, under plain
``torchrun``, and under Relay:

- the steps are ``[newest local checkpoint, total_steps)``: ``total_steps`` from
  ``init(total_steps=...)``, or ``init(epochs=...)`` times ``len(loader)`` at
  ``session.batches(loader)``, or the ``RELAY_TOTAL_STEPS`` environment variable;
- rank 0 checkpoints the tracked state every ``checkpoint_every`` steps (default
  100) and at the end, to ``checkpoint_dir`` (``init(checkpoint_dir=...)``, else
  ``RELAY_CHECKPOINT_DIR``, else ``./checkpoints``) as ``step-NNNNNNNN.pt`` (written
  to a temporary name, then renamed; the newest two are kept); every rank resumes
  from the newest one (the ranks must see the same folder: one machine, or shared
  storage);
- torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) makes the
  process group; a single process without it joins a group of one (on a free port),
  so DDP code runs unchanged;
- no heartbeats, no MLflow, no rescue or drain, no fault injection.

Imports torch and the standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relay_train.batches import epoch_batches, steps_per_epoch
from relay_train.checkpoints.checkpointer import restore_rng, snapshot_state
from relay_train.device import PlacedRank, RankDevice, setup_rank_device
from relay_train.protocol.env import ENV_LOCAL_CHECKPOINT_DIR, ENV_TOTAL_STEPS
from relay_train.reduce import comm_hook
from relay_train.session_state import StateFn

log = logging.getLogger("relay_train")

DEFAULT_CHECKPOINT_DIR = "checkpoints"
DEFAULT_CHECKPOINT_EVERY = 100
KEEP_CHECKPOINTS = 2
_CHECKPOINT = re.compile(r"step-(\d{8})\.pt")


def checkpoint_name(step: int) -> str:
    """Return the file name of the local checkpoint at ``step``."""
    return f"step-{step:08d}.pt"


def local_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Return the complete checkpoints in ``folder`` as (step, path), oldest first."""
    if not folder.is_dir():
        return []
    found = ((_CHECKPOINT.fullmatch(p.name), p) for p in folder.iterdir())
    return sorted((int(m.group(1)), p) for m, p in found if m is not None)


class LocalSession(PlacedRank):
    """This rank's session outside Relay; made by :func:`relay_train.init`."""

    def __init__(self, *, total_steps: int | None = None, epochs: int | None = None,
                 checkpoint_dir: str | Path | None = None,
                 checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, seed: int = 0) -> None:
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            _single_process_environment()  # dist.init_process_group(backend) works as-is
        self.rank = int(os.environ["RANK"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.seed = seed
        self.checkpoint_every = checkpoint_every
        self.epochs = epochs
        env_total = os.environ.get(ENV_TOTAL_STEPS)
        self._total = total_steps if total_steps is not None else (
            int(env_total) if env_total and epochs is None else None)
        folder = checkpoint_dir or os.environ.get(ENV_LOCAL_CHECKPOINT_DIR) or \
            DEFAULT_CHECKPOINT_DIR
        self.checkpoint_dir = Path(folder).resolve()
        newest = local_checkpoints(self.checkpoint_dir)[-1:]
        self._resume = newest[0][1] if newest else None
        self.start_step = newest[0][0] if newest else 0
        self.step = self.start_step  # the step the loop is on
        self._state_fn: StateFn | None = None
        self._placement: RankDevice | None = None
        self._last_saved = -1
        log.info("relay_train: not under Relay; local session, rank %d of %d, from step %d "
                 "(checkpoints in %s)", self.rank, self.world_size, self.start_step,
                 self.checkpoint_dir)

    # -- where the run starts and ends --------------------------------------------------

    @property
    def total_steps(self) -> int:
        """Return the run's last step (from ``init``'s arguments or ``RELAY_TOTAL_STEPS``)."""
        if self._total is None:
            raise RuntimeError(
                "relay_train: not under Relay, and the run's length is unknown. Expected "
                "relay_train.init(total_steps=N), relay_train.init(epochs=N) with "
                f"session.batches(loader), or the {ENV_TOTAL_STEPS} environment variable; "
                "found none of them.")
        return self._total

    @property
    def end_step(self) -> int:
        """Return the step the run ends at (exclusive): a local run is one segment."""
        return self.total_steps

    @property
    def placement(self) -> RankDevice:
        """Return where this rank computes: backend, device, DDP arguments (set up once)."""
        if self._placement is None:
            self._placement = setup_rank_device(
                "auto", local_rank=self.local_rank,
                local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), deterministic=True)
        return self._placement

    def init_process_group(self) -> None:
        """Join the process group torchrun's environment describes (env://)."""
        dist.init_process_group(self.backend, init_method="env://", rank=self.rank,
                                world_size=self.world_size)

    # -- the loop -----------------------------------------------------------------------

    def steps(self) -> Iterator[int]:
        """Yield the steps from the newest local checkpoint to ``total_steps``."""
        self._same_start_everywhere()
        for step in range(self.start_step, self.total_steps):
            self.step = step
            yield step

    def batches(self, loader: Any) -> Iterator[tuple[int, int, Any]]:  # noqa: ANN401
        """Yield (epoch, batch index, batch) for the run's steps (see relay_train.batches)."""
        if self._total is None and self.epochs is not None:
            self._total = self.epochs * steps_per_epoch(loader)
        return epoch_batches(loader, self.steps(), seed=self.seed)

    def comm_hook(self, *, ordered: bool = True) -> Any:  # noqa: ANN401 - DDP's hook type
        """Return the DDP comm hook Relay's session gives (the rank-order sum, no phase)."""
        return comm_hook(lambda: None, ordered=ordered)

    def mark_collectives(self, model: torch.nn.Module) -> None:
        """Nothing to mark outside Relay (no heartbeat)."""

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Nothing to mark outside Relay."""
        yield

    def enter_collective(self) -> None:
        """Nothing to mark outside Relay."""

    @contextlib.contextmanager
    def update(self, step: int | None = None) -> Iterator[None]:
        """Nothing to lock outside Relay (no rescue)."""
        yield

    def report(self, step: int | None = None, *, loss: float | None = None,
               samples: int = 0) -> None:
        """Checkpoint when the run's schedule says so (no heartbeat, no metrics)."""
        done = (self.step if step is None else step) + 1
        if self._state_fn is not None and self.checkpoint_due(done):
            self.save(done)

    # -- state --------------------------------------------------------------------------

    def track(self, state_fn: StateFn) -> None:
        """Name the state to checkpoint (a function returning it)."""
        self._state_fn = state_fn

    def checkpoint_due(self, step: int) -> bool:
        """Return whether the run checkpoints after ``step`` steps."""
        return step % self.checkpoint_every == 0 or step == self.total_steps

    def resume_state(self, *, restore_rng_state: bool = True) -> dict[str, Any] | None:
        """Return the newest local checkpoint's state (RNG restored), or None at step 0."""
        if self._resume is None:
            return None
        state = torch.load(self._resume, map_location="cpu", weights_only=True)
        if int(state["step"]) != self.start_step:
            raise RuntimeError(f"checkpoint {self._resume}: expected step {self.start_step}, "
                               f"found {state['step']}; the file was renamed or rewritten")
        if restore_rng_state and "rng" in state:
            restore_rng(state)
        log.info("rank %d resumes from step %d (%s)", self.rank, self.start_step, self._resume)
        return state

    def save(self, step: int, state: dict[str, Any] | None = None) -> float:
        """Rank 0: write ``state`` (or the tracked state) as the checkpoint at ``step``."""
        if self.rank != 0 or step == self._last_saved:
            return 0.0
        if state is None:
            if self._state_fn is None:
                raise RuntimeError("relay_train: nothing to checkpoint. Expected "
                                   "session.track(fn) or session.save(step, state); found "
                                   "neither.")
            state = self._state_fn()
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        final = self.checkpoint_dir / checkpoint_name(step)
        partial = final.with_suffix(".partial")
        torch.save(snapshot_state(state, step), partial)
        os.replace(partial, final)
        self._last_saved = step
        for _, old in local_checkpoints(self.checkpoint_dir)[:-KEEP_CHECKPOINTS]:
            old.unlink(missing_ok=True)
        return 0.0

    def close(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def _same_start_everywhere(self) -> None:
        """Refuse ranks that found different newest checkpoints (folders not shared)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        starts = [torch.zeros(1, dtype=torch.int64, device=self.device)
                  for _ in range(dist.get_world_size())]
        dist.all_gather(starts, torch.tensor([self.start_step], device=self.device))
        found = [int(t.item()) for t in starts]
        if len(set(found)) > 1:
            raise RuntimeError(
                f"relay_train: the ranks found different newest checkpoints in "
                f"{self.checkpoint_dir} (steps by rank: {found}); expected one folder every "
                "rank sees. Give init(checkpoint_dir=...) a folder on shared storage.")


def _single_process_environment() -> None:
    """Describe a process group of one, as torchrun would for ``--nproc-per-node 1``."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(name, value)
