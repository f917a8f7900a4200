"""Small things of a rank's life: start-up clock, moving averages, a safe exit."""

from __future__ import annotations

import os
import time
from typing import Any

from relay_train.protocol.env import ENV_SPAWNED_AT


class StartupClock:
    """Seconds spent in each start-up phase, for one log line (what a resume costs)."""

    def __init__(self) -> None:
        spawned = os.environ.get(ENV_SPAWNED_AT)
        self.origin = float(spawned) if spawned else time.time()
        self.last = self.origin
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """Close ``phase`` now."""
        now = time.time()
        self.phases[phase] = now - self.last
        self.last = now

    def summary(self) -> str:
        """Return e.g. ``5.10s (imports 2.31s, rendezvous 1.20s, ...)``."""
        parts = ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items())
        return f"{self.last - self.origin:.2f}s ({parts})"


class Ewma:
    """An exponentially weighted moving average (recent steps count most)."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, sample: float) -> float:
        """Fold in one sample and return the average."""
        self.value = sample if self.value is None else (
            self.alpha * sample + (1 - self.alpha) * self.value
        )
        return self.value


# Freeing DDP's reducer can deadlock with gloo: ~ProcessGroupGloo waits for a work thread
# that needs the GIL to free the last all-gather's tensors, while the freeing thread holds
# it (seen as a rank stuck at exit after its segment). close() keeps every DDP module
# referenced here, and the rank leaves through os._exit (relay_train.worker) without freeing them.
_KEEP_ALIVE: list[Any] = []


def keep_ddp_alive() -> None:
    """Keep every DDP module referenced until the process leaves (see _KEEP_ALIVE).

    The scan compares exact types: ``isinstance`` on each of the ~400,000 objects
    a rank holds (torch and MLflow imported) took twice as long, on the path
    from the last step to the rank's exit.
    """
    import gc

    from torch.nn.parallel import DistributedDataParallel as Ddp

    ddp_types = _subclasses(Ddp)
    _KEEP_ALIVE.extend(o for o in gc.get_objects() if type(o) in ddp_types)


def _subclasses(cls: type) -> set[type]:
    """Return ``cls`` and every class derived from it, however indirectly."""
    found, todo = set(), [cls]
    while todo:
        klass = todo.pop()
        if klass not in found:
            found.add(klass)
            todo.extend(klass.__subclasses__())
    return found
