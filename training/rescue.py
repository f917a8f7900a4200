"""Rescue: a healthy rank hands over its in-memory state when another rank has failed.

When a rank hangs or a node stops answering, the other ranks are blocked in
the step's collective, holding weights and optimizer state that are complete
up to the last finished step; every rank holds the same (DDP keeps replicas
equal). Relay asks one of them for that state instead of throwing away the
steps since the last periodic checkpoint. A thread in each rank watches for
the request (one ``stat`` per poll), snapshots under the lock the training
loop holds around its optimizer step, and writes the checkpoint file next to
the attempt. Relay, which stops the workload afterwards, verifies and
publishes it. Nothing here touches MLflow: a frozen rank may hold its lock.

The files, in ``<attempt>/rescue/``, and the :class:`RescueResult` Relay reads are
the protocol's (:mod:`relay_train.protocol.rescue_files`); this module imports
torch only to save.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from relay_train.protocol.heartbeat import write_atomically
from relay_train.protocol.manifest import CHECKPOINT_FILE, file_sha256
from relay_train.protocol.rescue_files import (
    ACK_FILE,
    DONE_FILE,
    REQUEST_FILE,
    RESCUE_DIR,
    RescueResult,
)
from relay_train.protocol.routes import RANK, STOP_AT

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1


class TrainingState:
    """The loop's step counter and the lock that keeps it in step with the weights.

    The loop holds :attr:`lock` across ``optimizer.step()`` and the counter's
    update, so a snapshot taken under the lock is exactly the state after
    :attr:`completed` steps, whatever the loop is doing (it may be blocked in
    a collective that will never finish).
    """

    def __init__(self, completed: int) -> None:
        self.lock = threading.Lock()
        self.completed = completed
        self.finite = True


class RescueResponder:
    """Answer a rescue request addressed to this rank, once, from a daemon thread."""

    def __init__(
        self,
        attempt_dir: Path,
        rank: int,
        state: TrainingState,
        snapshot: Callable[[int], dict[str, Any]],
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        self.dir = attempt_dir / RESCUE_DIR
        self.rank = rank
        self.state = state
        self._snapshot = snapshot
        self._poll = poll_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rescue", daemon=True)

    def start(self) -> None:
        """Start watching for a request."""
        self._thread.start()

    def close(self) -> None:
        """Stop watching (the segment ended normally)."""
        self._stop.set()

    def _requested(self) -> bool:
        try:
            request = json.loads((self.dir / REQUEST_FILE).read_text())
        except (OSError, ValueError):
            return False  # none yet, or being written: look again next poll
        return isinstance(request, dict) and request.get(RANK) == self.rank

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            if self._requested():
                try:
                    self.respond()
                except Exception:  # noqa: BLE001 - Relay falls back to the last checkpoint
                    log.exception("rank %d could not hand over its state", self.rank)
                    self._write_done(RescueResult(self.rank, refused="error; see the rank log"))
                return

    def respond(self) -> RescueResult:
        """Snapshot under the loop's lock, write the checkpoint, report it."""
        started = time.perf_counter()
        write_atomically(self.dir / ACK_FILE, json.dumps({"rank": self.rank, "pid": os.getpid()}))
        with self.state.lock:
            step, finite = self.state.completed, self.state.finite
            state = self._snapshot(step) if finite else None
        import torch

        if state is None:
            result = RescueResult(self.rank, step=step, refused="the loss was not finite")
        else:
            path = self.dir / f"step-{step:08d}" / CHECKPOINT_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            torch.save(state, partial)
            partial.replace(path)
            result = RescueResult(
                self.rank, step=step, path=str(path), sha256=file_sha256(path),
                size_bytes=path.stat().st_size, seconds=time.perf_counter() - started,
            )
            log.warning("rank %d handed over its state after %d steps in %.2fs (%s)",
                        self.rank, step, result.seconds, path)
        self._write_done(result)
        return result

    def _write_done(self, result: RescueResult) -> None:
        write_atomically(self.dir / DONE_FILE, json.dumps(asdict(result)))


class DrainRequest:
    """Relay's request to stop at a given step after checkpointing (checkpoint_and_migrate).

    Relay picks a step at least two ahead of the fastest rank; ranks never drift
    more than one step apart (every step ends in an all-reduce), so every rank
    reads the request before reaching that step and all stop at the same one.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last: int | None = None

    def stop_at(self) -> int | None:
        """Return the step to stop at, once requested (one stat() per step otherwise)."""
        if self.last is None and self.path.exists():
            try:
                self.last = int(json.loads(self.path.read_text())[STOP_AT])
            except (OSError, ValueError, KeyError, TypeError):
                return None  # being written: read it next step
        return self.last
