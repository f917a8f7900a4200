"""Checkpoints: in-memory snapshot, asynchronous save and publish, verified load.

The training loop blocks only for :func:`snapshot` (a copy of every tensor);
writing, hashing and publishing run on one background thread, in order, so a
manifest is published strictly after its file and after every earlier one.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from relay_train import rng as rng_states
from relay_train.errors import CorruptCheckpointError
from relay_train.protocol.manifest import (
    CHECKPOINT_FILE,
    FORMAT_DCP,
    FORMAT_TORCH,
    CheckpointManifest,
    CheckpointRef,
    file_sha256,
    files_digest,
    tree_sha256s,
)
from relay_train.protocol.signing import KeyRing, sign

log = logging.getLogger(__name__)


class CheckpointSink(Protocol):
    """Where finished checkpoints go (MLflow in production, a folder in tests)."""

    run_id: str

    def publish(self, checkpoint: Path, manifest: CheckpointManifest) -> None:
        """Store ``checkpoint`` (a file or a DCP folder), then its manifest; raise on failure."""


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_clone(v) for v in obj)
    return obj


def snapshot_state(state: dict[str, Any], step: int,
                   rng: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copy ``state`` into fresh memory, with the step count and the RNG states.

    ``step`` and ``rng`` are Relay's keys in a checkpoint; everything else is the script's.
    ``rng``: this process's states (:func:`relay_train.rng.capture`) unless given.
    """
    reserved = {"step", "rng"} & state.keys()
    if reserved:
        raise ValueError(f"checkpoint state: keys {sorted(reserved)} are Relay's; rename them")
    return {"step": step, "rng": rng_states.capture() if rng is None else rng, **_clone(state)}


def snapshot(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, extra: dict[str, Any]
) -> dict[str, Any]:
    """Copy a model's and optimizer's state (and ``extra``) to resume at ``step``."""
    return snapshot_state(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra}, step
    )


def load_verified(path: Path, expected_sha256: str) -> dict[str, Any]:
    """Load a checkpoint after checking its sha256; never unpickle arbitrary objects."""
    if path.is_dir():
        raise ValueError(
            f"checkpoint {path}: expected one checkpoint file, found a folder (a DCP "
            "checkpoint); load it with relay_train.checkpoints.dcp.load_dcp"
        )
    actual = file_sha256(path)
    if actual != expected_sha256:
        raise CorruptCheckpointError(
            f"checkpoint {path}: expected sha256 {expected_sha256}, found {actual}. "
            "The file was damaged after it was logged; resume from the previous checkpoint."
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def restore_rng(state: dict[str, Any], rank: int = 0,
                data_generator: torch.Generator | None = None) -> bool:
    """Put back ``rank``'s RNG states saved with a checkpoint; return whether they were its
    own (else the saving rank's: an older checkpoint, or a rescued state)."""
    saved, own = rng_states.rank_state(state["rng"], rank)
    rng_states.restore(saved, data_generator)
    return own


@dataclass
class SaveStats:
    """What saving one checkpoint cost the training loop."""

    step: int
    stall_seconds: float


class Checkpointer:
    """Save checkpoints of one rank, publishing them in order, sync or async."""

    def __init__(
        self,
        sink: CheckpointSink,
        staging_dir: Path,
        *,
        job: str,
        world_size: int,
        parent: CheckpointRef | None,
        keys: KeyRing,
        asynchronous: bool = True,
        on_published: Callable[[CheckpointManifest], None] | None = None,
    ) -> None:
        self._sink = sink
        self._staging = staging_dir
        self._staging.mkdir(parents=True, exist_ok=True)
        self._job = job
        self._world_size = world_size
        self._parent = parent
        self._keys = keys  # every manifest is signed with its writing key
        self._async = asynchronous
        self._on_published = on_published
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self.published: list[CheckpointManifest] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        if asynchronous:
            self._thread = threading.Thread(target=self._drain, name="checkpointer", daemon=True)
            self._thread.start()

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int,
        extra: dict[str, Any],
    ) -> SaveStats:
        """Checkpoint the state after ``step`` steps; return how long the loop was blocked."""
        started = time.perf_counter()
        self.save_state(snapshot(model, optimizer, step, extra))
        return SaveStats(step=step, stall_seconds=time.perf_counter() - started)

    def save_state(self, state: dict[str, Any],
                   complete: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Queue a snapshot made by :func:`snapshot_state` for writing and publishing;
        ``complete`` (on the publishing thread) may add to it before it is written."""
        self._raise_if_failed()
        self.submit(functools.partial(self._write_and_publish, state, complete))

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` in order with the checkpoints (beside the loop when async)."""
        if self._closed:
            raise RuntimeError("checkpointer is closed; nothing more can be published")
        if self._async:
            self._queue.put(work)
            return
        try:
            work()
        except BaseException as exc:
            self._error = exc
            raise

    def flush(self, timeout_seconds: float) -> bool:
        """Wait (at most ``timeout_seconds``) until the work queued so far is done; return
        whether it is (a failure counts as done: :meth:`close` re-raises it)."""
        if not self._async or self._closed:
            return True
        done = threading.Event()
        self.submit(done.set)
        return done.wait(timeout_seconds)

    def close(self, timeout_seconds: float = 300.0) -> None:
        """Wait until every queued checkpoint is published; re-raise a failure."""
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_seconds)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoints still publishing after {timeout_seconds}s")
            self._thread = None
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("an earlier checkpoint failed to publish") from self._error

    def _drain(self) -> None:
        while (work := self._queue.get()) is not None:
            if self._error is not None:
                continue  # after a failure nothing later may be published out of order
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - surfaced by close()/save()
                log.exception("Background checkpoint work failed")
                self._error = exc

    def _write_and_publish(self, state: dict[str, Any],
                           complete: Callable[[dict[str, Any]], None] | None = None) -> None:
        if complete is not None:
            complete(state)
        step = int(state["step"])
        path = self._staging / f"step-{step:08d}" / CHECKPOINT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        self.publish_written(path, step)

    def publish_written(self, path: Path, step: int) -> CheckpointManifest:
        """Hash a checkpoint already written (a file or a DCP folder), sign its manifest,
        then publish it.

        Run it through :meth:`submit` so it stays in order with the other checkpoints.
        """
        if path.is_dir():
            files = tree_sha256s(path)
            fmt, sha256 = FORMAT_DCP, files_digest(files)
            size = sum((path / name).stat().st_size for name in files)
        else:
            files, fmt, sha256, size = {}, FORMAT_TORCH, file_sha256(path), path.stat().st_size
        manifest = CheckpointManifest(
            step=step,
            sha256=sha256,
            size_bytes=size,
            world_size=self._world_size,
            job=self._job,
            run_id=self._sink.run_id,
            parent=self._parent,
            created_at=time.time(),
            format=fmt,
            files=files,
        )
        manifest = sign(manifest, self._keys)
        self._sink.publish(path, manifest)
        self._parent = manifest.ref
        self.published.append(manifest)
        log.info("Checkpoint at step %d published (%s, %d bytes)", step, fmt, size)
        if self._on_published is not None:
            self._on_published(manifest)
        return manifest
