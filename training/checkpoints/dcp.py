"""Sharded checkpoints: ``torch.distributed.checkpoint`` (DCP) folders, hashed and verified.

Saving: every rank calls :meth:`DcpCheckpointer.save` with its (possibly DTensor /
FSDP2-sharded) state. DCP's ``async_save`` copies the state to CPU memory -- the only
time the loop blocks -- and writes the folder on a thread, over a gloo group of its
own so its collectives never interleave with the training loop's. DCP's coordinator
finishes a save only after every rank reported its files written, so when its save is
done the folder is complete: the coordinator then hashes every file and publishes the
folder and its manifest (a sha256 per file) through the same :class:`Checkpointer` as
single-file checkpoints, so they stay in order and keep one parent chain. DCP itself
checksums nothing.

Loading: :func:`load_dcp` checks every file against the manifest (no file missing,
none extra, every sha256 equal) before DCP reads a byte. That matters twice: a damaged
shard would otherwise load silently, and DCP unpickles its ``.metadata``.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from relay_train.checkpoints.checkpointer import Checkpointer, SaveStats
from relay_train.errors import CorruptCheckpointError
from relay_train.protocol.launch import ResumeFrom
from relay_train.protocol.manifest import DCP_DIR, FORMAT_DCP, files_digest, tree_mismatches

log = logging.getLogger(__name__)

DCP_METADATA_FILE = ".metadata"  # written by DCP's coordinator when a save is complete


def model_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Return ``{"model", "optimizer", **extra}`` as DCP saves it (sharded stays sharded)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, **(extra or {})}


class DcpCheckpointer:
    """Save DCP checkpoints from every rank; the coordinator hashes and publishes them."""

    def __init__(
        self,
        staging_dir: Path,
        publisher: Checkpointer | None,
        *,
        asynchronous: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        """Make one on every rank at the same point: it creates a process group.

        ``staging_dir`` must be storage every rank writes to (the attempt folder);
        ``publisher`` is the coordinator's (rank 0's) :class:`Checkpointer`, None elsewhere.
        """
        self._staging = staging_dir
        self._publisher = publisher
        self._async = asynchronous
        if process_group is None and asynchronous and dist.is_initialized():
            # Collectives of the writer thread must not share a group with the loop's.
            process_group = dist.new_group(backend="gloo")
        self._group = process_group
        self._pending: Future[Any] | None = None

    def save(self, state: dict[str, Any], step: int) -> SaveStats:
        """Checkpoint ``state`` after ``step`` steps on this rank; return the loop's stall.

        Waits first for this rank's previous DCP save (two must not overlap: they share
        one process group), so the stall includes any of it still running.
        """
        started = time.perf_counter()
        self._wait_pending()
        folder = self._staging / f"step-{step:08d}" / DCP_DIR
        folder.mkdir(parents=True, exist_ok=True)
        future: Future[Any]
        if self._async:
            response = dcp.async_save(state, checkpoint_id=folder, process_group=self._group)
            future = (response.upload_completion
                      if isinstance(response, AsyncSaveResponse) else response)
        else:
            future = Future()
            future.set_result(dcp.save(state, checkpoint_id=folder, process_group=self._group))
        self._pending = future
        if self._publisher is not None:
            self._publisher.submit(functools.partial(self._publish, future, folder, step))
        return SaveStats(step=step, stall_seconds=time.perf_counter() - started)

    def save_model(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        step: int,
        extra: dict[str, Any] | None = None,
    ) -> SaveStats:
        """Checkpoint a (sharded) model and its optimizer, see :func:`model_state`."""
        return self.save(model_state(model, optimizer, extra), step)

    def close(self) -> None:
        """Wait until this rank's last DCP save is written; re-raise its failure.

        The publisher (the coordinator's Checkpointer) is its owner's to close.
        """
        self._wait_pending()

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _publish(self, written: Future[Any], folder: Path, step: int) -> None:
        metadata = written.result()  # the coordinator's save ends after every rank's writes
        if isinstance(metadata, Metadata):
            expected = {info.relative_path for info in metadata.storage_data.values()}
            expected.add(DCP_METADATA_FILE)
            found = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
            if found != expected:
                raise RuntimeError(
                    f"DCP checkpoint {folder}: expected exactly the files DCP wrote "
                    f"{sorted(expected)}, found {sorted(found)}; save each step into a fresh "
                    "staging folder (nothing else may write there)"
                )
        assert self._publisher is not None
        self._publisher.publish_written(folder, step)


def verify_dcp(resume: ResumeFrom, process_group: dist.ProcessGroup | None = None) -> None:
    """Check every file of a DCP resume folder against its manifest, or raise.

    With a process group, the ranks split the hashing and all raise the same error.
    """
    if resume.format != FORMAT_DCP:
        raise ValueError(
            f"resume point {resume.path}: expected format {FORMAT_DCP!r}, found "
            f"{resume.format!r}; load it with relay_train.checkpoints.checkpointer.load_verified"
        )
    where = f"DCP checkpoint {resume.path} (step {resume.step}, run {resume.run_id})"
    if files_digest(resume.files) != resume.sha256:
        raise CorruptCheckpointError(
            f"{where}: its file table does not match the manifest's sha256 "
            f"{resume.sha256}; the launch file was altered: relaunch from the manifest in MLflow"
        )
    share = (0, 1)
    if dist.is_initialized():
        share = (dist.get_rank(process_group), dist.get_world_size(process_group))
    problems = [str(p) for p in tree_mismatches(Path(resume.path), resume.files, share)]
    if dist.is_initialized():
        gathered: list[list[str] | None] = [None] * share[1]
        dist.all_gather_object(gathered, problems, group=process_group)
        problems = sorted(p for part in gathered for p in part or [])
    if problems:
        raise CorruptCheckpointError(
            f"{where} does not match its manifest: " + "; ".join(problems)
            + ". The folder was damaged after it was logged; do not load it: resume from "
            "the previous checkpoint (Relay does so on its next try)."
        )


def load_dcp(
    resume: ResumeFrom, state: dict[str, Any], process_group: dist.ProcessGroup | None = None
) -> None:
    """Verify the resume folder, then load it into ``state`` in place (on every rank)."""
    verify_dcp(resume, process_group)
    dcp.load(state, checkpoint_id=resume.path, process_group=process_group)
    log.info("Loaded DCP checkpoint at step %d from %s", resume.step, resume.path)


def load_model(
    resume: ResumeFrom,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Verify and load a checkpoint saved by :meth:`DcpCheckpointer.save_model`.

    ``extra`` gives the shape of the extras saved with it; returns the loaded state.
    """
    state = model_state(model, optimizer, extra)
    load_dcp(resume, state)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    return state
