"""One rank's random number generators: captured with each checkpoint, restored per rank.

What a rank draws from: Python's ``random``, NumPy's global generator (when NumPy is
importable), torch's CPU generator, every CUDA device's (when CUDA is available), and
the generator a script hands its ``DataLoader`` (``session.data_generator()``: the
loader draws its workers' base seed from it, so worker seeds resume too). A state is
made of tensors, ints and tuples only, so checkpoints still load with
``weights_only=True``.

Rank 0 writes the checkpoint, so the other ranks' states reach it through the process
group's store (:class:`RankStates`): a rank posts its states when it passes a checkpoint
step (never waits), and rank 0's publishing thread collects them, off the training loop.
Imports torch and the standard library only.
"""

from __future__ import annotations

import io
import logging
import random
import time
from datetime import timedelta
from typing import Any

import torch

log = logging.getLogger(__name__)

STORE_PREFIX = "relay/rng"
COLLECT_TIMEOUT_SECONDS = 10.0  # a rank that did not pass the step by then keeps rank 0's


def _numpy() -> Any:  # noqa: ANN401 - the numpy module, or None
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def capture(data_generator: torch.Generator | None = None) -> dict[str, Any]:
    """Return this process's RNG states (and the DataLoader generator's, if one)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    numpy = _numpy()
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = (str(name), torch.from_numpy(keys.astype("int64")), int(pos),
                          int(has_gauss), float(cached))
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if data_generator is not None:
        state["data"] = data_generator.get_state()
    return state


def restore(state: dict[str, Any], data_generator: torch.Generator | None = None) -> None:
    """Put back states made by :func:`capture` (those present; the others stay as they are)."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    numpy = _numpy()
    if numpy is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "data" in state and data_generator is not None:
        data_generator.set_state(state["data"])


def rank_state(saved: dict[str, Any], rank: int) -> tuple[dict[str, Any], bool]:
    """Return the RNG state ``rank`` resumes with, and whether it is that rank's own.

    A checkpoint holds every rank's states under ``ranks``; an older one (or a rescued
    state, which holds only the rank that handed it over) falls back to the saving
    rank's states, which are also at the top level.
    """
    own = saved.get("ranks", {}).get(str(rank))
    return (own, True) if own is not None else (saved, False)


def _store() -> Any:  # noqa: ANN401 - a torch.distributed Store, or None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


class RankStates:
    """Every rank's RNG states as of a checkpoint step, gathered at rank 0 via the store."""

    def __init__(self, rank: int, world_size: int,
                 timeout_seconds: float = COLLECT_TIMEOUT_SECONDS) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_seconds = timeout_seconds
        self.silent: set[int] = set()  # ranks that never posted: not waited for again

    @staticmethod
    def key(step: int, rank: int) -> str:
        """Return the store key of ``rank``'s states as of ``step`` steps."""
        return f"{STORE_PREFIX}/{step}/{rank}"

    def post(self, step: int, state: dict[str, Any]) -> None:
        """A rank other than 0: offer its states as of ``step`` steps to rank 0 (no wait)."""
        store = _store()
        if store is None or self.rank == 0:
            return
        buffer = io.BytesIO()
        torch.save(state, buffer)
        store.set(self.key(step, self.rank), buffer.getvalue())

    def collect(self, step: int, own: dict[str, Any]) -> dict[str, Any]:
        """Rank 0 (on the publishing thread): return every rank's states, by rank as a string.

        A rank whose states do not come within the timeout is left out (it resumes with
        rank 0's), and not waited for at later checkpoints (a script that saves on rank 0
        only).
        """
        states = {str(self.rank): own}
        store = _store()
        if store is None:
            return states
        deadline = time.monotonic() + self.timeout_seconds
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = self.key(step, rank)
            try:
                wait = 0.001 if rank in self.silent else deadline - time.monotonic()
                store.wait([key], timedelta(seconds=max(0.001, wait)))
                states[str(rank)] = torch.load(io.BytesIO(store.get(key)), weights_only=True)
                store.delete_key(key)
                self.silent.discard(rank)
            except Exception:  # noqa: BLE001 - a missing rank must not lose the checkpoint
                if rank not in self.silent:
                    log.warning("checkpoint at step %d: rank %d's RNG states did not arrive "
                                "within %gs; it resumes with rank %d's", step, rank,
                                self.timeout_seconds, self.rank)
                self.silent.add(rank)
        return states
