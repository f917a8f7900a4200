"""Rank 0's metrics on their way to MLflow: few requests while the loop runs, none lost to a stall.

Each request is the MLflow client's Python in rank 0's publisher thread, holding the GIL
the training loop needs: tens of ms against a local store. One every 5 steps, four a
second at the tiny model's pace, kept rank 0's compute 1.4-2.6x the other ranks' for
polls on end under load, and the watcher saw a straggler
(``relay.tools.bench.cpu_wait_probe``). So the loop sends a batch every
:data:`METRICS_EVERY` steps but at most once in :data:`METRICS_SECONDS`; and since a
batch held back must still reach MLflow when the loop stops stepping (a hang, a peer's
crash: the attempt is stopped, the pending figures with it), the heartbeat writer's
thread sends them once no step has ended for :func:`stall_seconds`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

METRICS_EVERY = 5  # steps a batch, at least
METRICS_SECONDS = 2.0  # seconds between two batches the loop sends, at least
STALL_STEPS = 3.0  # no step ended for this many usual step times: the loop stalled...
MIN_STALL_SECONDS = 0.5  # ...and for at least this long

Batch = list[tuple[int, dict[str, float], int]]  # (step, values, timestamp in ms)


def stall_seconds(step_seconds: float | None) -> float:
    """Return how long with no step ended counts as a stall, given the usual step time."""
    return max(MIN_STALL_SECONDS, STALL_STEPS * (step_seconds or 0.0))


class PendingMetrics:
    """The steps' metrics not sent yet; ``send`` hands a batch to the publisher thread."""

    def __init__(self, send: Callable[[Batch], None]) -> None:
        self._send = send
        self._lock = threading.Lock()  # the loop adds, the heartbeat thread may flush
        self._batch: Batch = []
        self.sent_at = -float("inf")  # time.monotonic() of the last batch
        self.added_at = time.monotonic()  # ... and of the last step's figures

    def add(self, step: int, values: Mapping[str, float]) -> None:
        """Keep one step's figures."""
        with self._lock:
            self._batch.append((step, dict(values), int(time.time() * 1000)))
            self.added_at = time.monotonic()

    def due(self, now: float) -> bool:
        """Return whether the loop sends now: METRICS_EVERY steps, METRICS_SECONDS since."""
        return len(self._batch) >= METRICS_EVERY and now - self.sent_at >= METRICS_SECONDS

    def stalled(self, now: float, step_seconds: float | None) -> bool:
        """Return whether figures wait while no step has ended for :func:`stall_seconds`."""
        return bool(self._batch) and now - self.added_at >= stall_seconds(step_seconds)

    def flush(self) -> None:
        """Send every figure kept (nothing when there is none)."""
        with self._lock:
            batch, self._batch = self._batch, []
            self.sent_at = time.monotonic()
        if batch:
            self._send(batch)
