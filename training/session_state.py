"""The state half of :class:`relay_train.api.Session`: resume, track, save, rescue.

What a rank resumes from (sha256-verified, fetched from MLflow to the node),
the state a script names with ``track``, its checkpoints (rank 0 publishes them
to MLflow off the loop's thread; sharded ones from every rank) and what a rescue
hands over, and which run they go to once a later segment adopts the workload
(:mod:`relay_train.boundary`). The loop, the heartbeat and the segment's bounds
are in :mod:`relay_train.api`, the collective-phase marks in
:mod:`relay_train.collectives`. Imports torch and the standard library only.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relay_train import rng
from relay_train.boundary import PUBLISH_WAIT_SECONDS, BoundaryKeeper
from relay_train.checkpoints.checkpointer import (
    Checkpointer,
    load_verified,
    restore_rng,
    snapshot_state,
)
from relay_train.checkpoints.fetch import fetch_resume
from relay_train.errors import CorruptCheckpointError
from relay_train.inject import ChaosMonkey
from relay_train.metrics import Batch, PendingMetrics
from relay_train.protocol.env import ENV_NODE
from relay_train.protocol.heartbeat import HeartbeatWriter, Phase
from relay_train.protocol.launch import LaunchConfig, ResumeFrom
from relay_train.protocol.manifest import CheckpointRef
from relay_train.protocol.signing import KeyRing, launch_ring, resume_problem
from relay_train.rescue import DrainRequest, TrainingState
from relay_train.timing import Ewma, StartupClock

log = logging.getLogger("relay_train")

StateFn = Callable[[], dict[str, Any]]


class SessionState:
    """Resume, track, save and rescue for a :class:`~relay_train.api.Session`."""

    # Set by Session.__init__; the loop's own parts stay there.
    cfg: LaunchConfig
    rank: int
    startup: StartupClock
    _state_fn: StateFn | None
    _objects: dict[str, Any]  # named objects with state_dict/load_state_dict (track)
    _rng_states: rng.RankStates
    _data_generator: torch.Generator | None
    _heartbeat: HeartbeatWriter
    _training: TrainingState
    _drain: DrainRequest
    _bounds: BoundaryKeeper
    _parent: CheckpointRef | None
    _checkpointer: Checkpointer | None
    _dcp: Any  # relay_train.checkpoints.dcp.DcpCheckpointer, made on the first sharded save
    _sink: Any
    _metrics: PendingMetrics
    _step_time: Ewma
    _stall: float
    _closed: bool
    _last_step: int
    _saved_at: int | None  # the step of this rank's newest save
    _loop_ended: bool
    _where: tuple[int, int]
    _chaos: ChaosMonkey
    _adopted: Any  # the adoption this rank's checkpoints and chaos follow
    start_step: int
    end_step: int

    def resume_state(self, *, restore_rng_state: bool = True) -> dict[str, Any] | None:
        """Return the verified state to resume from, or None when starting at step 0.

        The file's sha256 is checked against its manifest and it is loaded with
        ``weights_only=True``. This rank's RNG states saved with it are restored
        (Python's, NumPy's, torch's CPU and CUDA generators, :meth:`data_generator`'s),
        and the objects named in :meth:`track` load their state.
        """
        resume = self.cfg.resume
        if resume is None:
            return None
        if resume.format == "dcp":
            raise RuntimeError(
                f"relay_train: the resume checkpoint {resume.path} is a sharded "
                "torch.distributed.checkpoint folder; expected session.resume_sharded(state).")
        resume = self._fetched_resume()
        state = load_verified(Path(resume.path), resume.sha256)
        if int(state["step"]) != self.start_step:
            raise RuntimeError(
                f"checkpoint {resume.path}: expected step {self.start_step}, found "
                f"{state['step']}; the launcher and the checkpoint disagree"
            )
        if restore_rng_state and "rng" in state:
            if not restore_rng(state, self.rank, self._data_generator):
                log.warning("rank %d: the checkpoint at step %d holds no RNG states of this "
                            "rank (an older checkpoint, or a rescued state); it resumes with "
                            "the saving rank's. Bit-exact resume then needs seed_step (see "
                            "docs/worker-api.md).", self.rank, self.start_step)
        for name, obj in self._objects.items():
            obj.load_state_dict(state[name])
        log.info("rank %d resumes from step %d (%s)", self.rank, self.start_step, resume.path)
        self.startup.mark("restore")
        return state

    def _fetched_resume(self) -> ResumeFrom:
        """Return the resume point as a verified copy on this node, fetched from MLflow.

        Its manifest's signature is checked first: nothing is fetched, let alone
        unpickled (a checkpoint file, or a DCP folder's ``.metadata``), before it holds.
        """
        resume = self.cfg.resume
        assert resume is not None
        problem = resume_problem(resume, self._keys())
        if problem is not None:
            raise CorruptCheckpointError(
                f"checkpoint at step {resume.step} of run {resume.run_id}: {problem}. Not "
                "loaded: Relay records it as corrupt and resumes from the previous checkpoint "
                "on its next try.")
        cache = self.cfg.root / "resume" / os.environ.get(ENV_NODE, "node")  # node-local
        return fetch_resume(self.cfg.resume, self.cfg.tracking_uri, cache)

    def track(self, state_fn: StateFn | None = None, **objects: Any) -> None:  # noqa: ANN401
        """Name the state to checkpoint and to hand over in a rescue.

        ``state_fn`` returns a dict of it; it is called under the lock :meth:`update`
        holds, and its tensors are copied at once, so it may return live ``state_dict()``
        views. ``objects`` are more of it by name, anything with ``state_dict`` and
        ``load_state_dict`` (an LR scheduler, a ``GradScaler``, a model, an optimizer):
        saved under their names and loaded back by :meth:`resume_state`. Calls add up.
        """
        for name, obj in objects.items():
            if not callable(getattr(obj, "state_dict", None)) or \
                    not callable(getattr(obj, "load_state_dict", None)):
                raise TypeError(
                    f"relay_train: session.track({name}=...): expected an object with "
                    f"state_dict() and load_state_dict(), found {type(obj).__name__}. Track "
                    f"its state through the function instead: session.track(lambda: "
                    f"{{'{name}': ...}}).")
            if name in ("step", "rng"):
                raise ValueError(f"relay_train: session.track({name}=...): {name!r} is one of "
                                 "Relay's checkpoint keys; choose another name.")
        if state_fn is not None:
            self._state_fn = state_fn
        self._objects.update(objects)

    def data_generator(self) -> torch.Generator:
        """Return this rank's generator for a ``DataLoader`` (``generator=``), seeded from
        the job's seed and the rank, its state saved and restored with the RNG states: the
        loader draws its shuffling order and its workers' base seed from it."""
        if self._data_generator is None:
            self._data_generator = torch.Generator().manual_seed(
                self.cfg.seed * 1_000_003 + self.rank)
        return self._data_generator

    def save(self, step: int, state: dict[str, Any] | None = None) -> float:
        """Checkpoint ``state`` (or the tracked state) as of ``step`` steps; return the stall.

        Rank 0 publishes (DDP replicas are identical); on other ranks this is a
        no-op. Asynchronous: the loop waits only for an in-memory copy.
        """
        self._last_step = max(self._last_step, step)  # a script may save without report
        self._saved_at = step
        if self.rank != 0:
            self._rng_states.post(step, rng.capture(self._data_generator))
            return 0.0
        self._await_owner(step)
        started = time.perf_counter()
        if state is None:
            state = self._tracked()
        self._heartbeat.enter(Phase.CHECKPOINT)
        snap = snapshot_state(state, step, rng.capture(self._data_generator))
        self._publisher().save_state(snap, self._gather_rng)
        return time.perf_counter() - started

    def _gather_rng(self, snap: dict[str, Any]) -> None:
        """On the publishing thread: add every rank's RNG states to rank 0's snapshot."""
        own = snap["rng"]
        snap["rng"] = {**own, "ranks": self._rng_states.collect(int(snap["step"]), own)}

    def save_sharded(self, step: int, state: dict[str, Any]) -> float:
        """Checkpoint a sharded state (FSDP2/DTensor) as a ``torch.distributed.checkpoint``
        folder, from every rank; return the stall. Call it on every rank at the same step.

        The folder is published with a sha256 per file in its manifest, and is
        verified file by file before any resume (:meth:`resume_sharded`).
        """
        if self._dcp is None:
            from relay_train.checkpoints.dcp import DcpCheckpointer

            self._dcp = DcpCheckpointer(self.cfg.root / "staging",
                                        self._publisher() if self.rank == 0 else None)
        if self.rank == 0:
            self._await_owner(step)
        self._last_step = max(self._last_step, step)
        self._heartbeat.enter(Phase.CHECKPOINT)
        return self._dcp.save(state, step).stall_seconds

    def resume_sharded(self, state: dict[str, Any]) -> bool:
        """Load the resume checkpoint into ``state`` in place; return False at step 0.

        Every file is checked against its manifest's sha256 first (all ranks
        refuse a folder with any damaged, missing or extra file).
        """
        resume = self.cfg.resume
        if resume is None:
            return False
        if resume.format != "dcp":
            raise RuntimeError(
                f"relay_train: expected a torch.distributed.checkpoint folder to resume "
                f"from; found a {resume.format!r} checkpoint at {resume.path}. Use "
                "session.resume_state() for checkpoints made by session.save().")
        from relay_train.checkpoints.dcp import load_dcp

        load_dcp(self._fetched_resume(), state)
        self.startup.mark("restore")
        return True

    def checkpoint_due(self, step: int) -> bool:
        """Return whether the job's schedule (or a drain) checkpoints after ``step`` steps."""
        return (step % self.cfg.checkpoint_every == 0
                or step in (self.end_step, self._drain.last)
                or step in self._bounds.checkpoint_steps())

    def shortfall(self) -> tuple[int, int, int] | None:
        """Return (step reached, step expected, segment) if the script ended early.

        Not short: :meth:`steps` ran to its end (the segment's, a later one's after an
        adoption, or a drain's stop), or the steps reported or saved reached it.
        """
        if self._loop_ended:
            return None
        reached = self._last_step
        expected = self.end_step if reached < self.end_step else self._bounds.limit
        stop_at = self._drain.stop_at()
        if stop_at is not None:
            expected = min(expected, stop_at)
        return None if reached >= expected else (reached, expected, self._where[0])

    def finish_publishing(self, timeout_seconds: float = 3.0) -> None:
        """After a failure: let checkpoints already saved reach MLflow before the rank dies.

        A peer's crash ends this rank's loop within milliseconds, often while the
        checkpoint of a few steps ago is still uploading. SIGTERM (and SIGUSR1) is ignored
        meanwhile (the node agent SIGKILLs after its grace period anyway).
        """
        if self._checkpointer is None or self._closed:
            return
        self._closed = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a shielded rank's end (agent.ranks)
        try:
            self._checkpointer.close(timeout_seconds)
        except Exception:  # noqa: BLE001 - the rank is failing already; say why and go on
            log.exception("rank %d: checkpoints still unpublished at exit", self.rank)

    def _checkpoint(self, step: int, loss: float | None) -> None:
        if not self._training.finite:
            log.error("step %d: loss is not finite; not checkpointing poisoned weights", step)
            return
        stall = self._stall = self.save(step)
        log.info("step %d loss %s checkpoint stall %.4fs", step,
                 "-" if loss is None else f"{loss:.4f}", stall)
        # What checkpoint_every: auto weighs a save at (relay.lineage.interval).
        self._metrics.add(step, {"checkpoint_stall_seconds": stall})
        self._metrics.flush()

    def _send_metrics(self, batch: Batch) -> None:
        publisher, sink = self._publisher(), self._sink
        publisher.submit(lambda: sink.log_metrics(batch))

    def _send_stalled_metrics(self) -> None:
        """(The heartbeat writer's thread, each interval.) Send the figures a stalled loop
        holds back: the attempt may be stopped before its loop steps again."""
        if self._metrics.stalled(time.monotonic(), self._step_time.value):
            self._metrics.flush()

    def _tracked(self) -> dict[str, Any]:
        if self._state_fn is not None or self._objects:
            state = self._state_fn() if self._state_fn is not None else {}
            clash = state.keys() & self._objects.keys()
            if clash:
                raise ValueError(f"relay_train: tracked names {sorted(clash)} are both in "
                                 "session.track's function and named objects; keep one.")
            return {**state, **{name: obj.state_dict() for name, obj in self._objects.items()}}
        raise RuntimeError(
            "relay_train: nothing to checkpoint. Expected session.track(fn) or "
            "session.save(step, state); found neither. Call session.track(lambda: "
            "{'model': model.state_dict(), 'optimizer': optimizer.state_dict()}).")

    def _poison_tracked(self) -> None:
        """Chaos ``nan``: make the tracked weights NaN, as a real divergence would.

        The state dict's tensors share storage with the parameters, so the next
        forward pass (and the gradient all-reduce) carries the NaN to every rank.
        """
        if self._state_fn is None and not self._objects:
            return
        model = self._tracked().get("model", {})
        with torch.no_grad():
            for tensor in model.values():
                if torch.is_tensor(tensor) and tensor.is_floating_point():
                    tensor.fill_(math.nan)

    def _snapshot(self, step: int) -> dict[str, Any]:
        """Rescue: the tracked state after ``step`` steps (called under the update lock).

        Its RNG states are this rank's as the rescue finds them (mid-step, and no other
        rank's): no rank resumes from them as its own (see docs/worker-api.md).
        """
        return snapshot_state(self._tracked(), step,
                              {**rng.capture(self._data_generator), "ranks": {}})

    def _keys(self) -> KeyRing:
        """Return the deployment's checkpoint key ring (launch file, else a mounted file)."""
        try:
            return launch_ring(self.cfg.checkpoint_keys)
        except ValueError as exc:
            raise RuntimeError(f"relay_train: {exc}") from None

    # -- where the checkpoints go across segment boundaries (relay_train.boundary) ------

    def _await_published(self, step: int) -> float:
        """Rank 0, at a boundary: wait (bounded) until its checkpoint is in MLflow; return
        how long that took (see relay_train.boundary)."""
        started = time.perf_counter()
        if not self._publisher().flush(PUBLISH_WAIT_SECONDS):
            log.warning("step %d: the boundary checkpoint is not in MLflow after %.0fs; "
                        "training on", step, PUBLISH_WAIT_SECONDS)
        return time.perf_counter() - started

    def _await_owner(self, step: int) -> None:
        """Rank 0, at a later segment's end: wait (bounded) for that segment's task to adopt
        the workload, so this checkpoint goes to its run (see relay_train.boundary)."""
        if self._bounds.owner_pending(step) is None or self._drain.stop_at() is not None:
            return  # (a drained attempt's last checkpoint is awaited by its own task)
        self._heartbeat.enter(Phase.CHECKPOINT)  # not a stalled step: waiting for the task
        self._bounds.await_owner(step)
        self._follow_adoption(step)

    def _follow_adoption(self, step: int) -> None:
        """Send later checkpoints to the adopting attempt's run; aim chaos at its steps."""
        adopted = self._bounds.adoption
        if adopted is not None and adopted is not self._adopted:
            self._adopted = adopted
            if self.rank == 0:
                publisher, sink = self._publisher(), self._sink
                publisher.submit(lambda: setattr(sink, "run_id", adopted.run_id))  # in order
        where = self._bounds.where(step)
        if where != self._where:
            self._where = where
            self._chaos.move_to(*where)

    def _publisher(self) -> Checkpointer:
        if self._checkpointer is None:
            from relay_train.checkpoints.publish import MlflowCheckpointSink  # rank 0 only

            self._sink = MlflowCheckpointSink(self.cfg.tracking_uri, self.cfg.run_id)
            self._checkpointer = Checkpointer(
                self._sink, self.cfg.root / "staging", job=self.cfg.job,
                world_size=self.cfg.world_size, parent=self._parent, keys=self._keys())
            self._checkpointer.submit(self._sink.connect)  # off the loop's thread
        return self._checkpointer
