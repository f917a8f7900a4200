"""Relay's worker-side API: the only part of Relay a training script touches.

A script written for ``torchrun`` runs under Relay with a few added lines::

    import relay_train

    session = relay_train.init(total_steps=1000) # under Relay: this segment's steps;
                                                 # without: a local session (relay_train.local)
    dist.init_process_group(session.backend)     # or session.init_process_group()
    model = DDP(model)
    model.register_comm_hook(None, session.comm_hook())   # hangs get a culprit
    session.mark_collectives(model)              # DDP's buffer broadcast, FSDP2's all-gathers
    session.track(lambda: {"model": model.module.state_dict(),
                           "optimizer": optimizer.state_dict()})
    if (state := session.resume_state()) is not None:     # sha256-verified
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    for step in session.steps():                 # [resume step, segment end)
        loss = ...; loss.backward()
        with session.update(step):               # weights and step count move together
            optimizer.step()
        session.report(step, loss=loss.item(), samples=batch_size)  # heartbeat, checkpoints
    session.close()

An epoch loop over a ``DataLoader`` reads ``for epoch, index, batch in
session.batches(loader):`` instead (:mod:`relay_train.batches`); ``update()`` and
``report()`` then default to the loop's step.

``report`` checkpoints the tracked state on the job's schedule (asynchronously:
the loop blocks only for an in-memory copy), and answers Relay's rescue and
drain requests from it, so 0 lost steps after a hang or a dead node holds for
any script. A script may keep its own ``dist.init_process_group(session.backend)``;
``session.init_process_group()`` also spares ranks other than 0 torch's one-second
store backoff when rank 0 is not listening yet (up to a second per launch).
Imports torch and the standard library only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relay_train.batches import epoch_batches
from relay_train.boundary import BoundaryKeeper
from relay_train.checkpoints.checkpointer import Checkpointer
from relay_train.collectives import CollectivePhases, StepPhases
from relay_train.cpu_wait import CpuWait
from relay_train.device import PlacedRank, RankDevice, setup_rank_device
from relay_train.inject import ChaosMonkey
from relay_train.local import DEFAULT_CHECKPOINT_EVERY, LocalSession
from relay_train.metrics import PendingMetrics
from relay_train.protocol.env import ENV_LAUNCH, ENV_NODE
from relay_train.protocol.heartbeat import HeartbeatWriter
from relay_train.protocol.launch import (
    DRAIN_FILE,
    FIRST_STEP_FILE,
    RESULT_FILE,
    LaunchConfig,
)
from relay_train.protocol.manifest import CheckpointRef
from relay_train.rendezvous import MAX_WAIT_SECONDS, wait_for_store
from relay_train.rescue import DrainRequest, RescueResponder, TrainingState
from relay_train.rng import RankStates
from relay_train.session_state import SessionState, StateFn
from relay_train.stacks import EvidenceResponder
from relay_train.timing import Ewma, StartupClock, keep_ddp_alive

log = logging.getLogger("relay_train")

# The first steps of an attempt warm up (allocations, DDP's bucket rebuild after step one):
# they are not the rank's natural pace, which chaos stragglers are scaled by.
WARMUP_STEPS = 2

class Session(SessionState, CollectivePhases, PlacedRank):
    """This rank's view of one segment attempt; made by :func:`init`."""

    def __init__(self, cfg: LaunchConfig, rank: int, node: str) -> None:
        self.cfg = cfg
        self.rank = rank
        self.node = node
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.startup = StartupClock()
        self._state_fn: StateFn | None = None
        self._objects: dict[str, Any] = {}
        self._data_generator: torch.Generator | None = None
        self._rng_states = RankStates(rank, cfg.world_size)
        self._placement: RankDevice | None = None
        self._chaos = ChaosMonkey(cfg.chaos, segment=cfg.segment, attempt=cfg.attempt,
                                  rank=rank, node=node, record_dir=cfg.root,
                                  announce=cfg.logs_to_mlflow)  # Relay can't read this disk
        self._heartbeat = HeartbeatWriter(cfg.heartbeat_dir, rank, node,
                                          cfg.heartbeat_interval_seconds, step=cfg.start_step)
        self._phases = StepPhases(self._heartbeat)
        self._training = TrainingState(cfg.start_step)
        self._responder = RescueResponder(cfg.root, rank, self._training, self._snapshot)
        self._evidence = EvidenceResponder(cfg.root, rank, node)  # stacks + collective trace
        self._drain = DrainRequest(cfg.root / DRAIN_FILE)
        self._bounds = BoundaryKeeper(cfg, rank)  # training on past end_step, until adopted
        self._where = (cfg.segment, cfg.attempt)
        self._adopted: Any = None  # the adoption this rank's checkpoints and chaos follow
        self._stall = 0.0
        resume = cfg.resume
        self._parent = CheckpointRef(resume.run_id, resume.step, resume.sha256) if resume else None
        self._checkpointer: Checkpointer | None = None
        self._dcp: Any = None  # checkpoints.dcp.DcpCheckpointer, made at the first sharded save
        self._sink: Any = None
        self._metrics = PendingMetrics(self._send_metrics)  # rank 0's (relay_train.metrics)
        self._clock: dict[str, float] = {}
        self._compute, self._natural, self._rate = Ewma(), Ewma(), Ewma()
        self._compute_total = 0.0  # seconds of compute over this rank's steps (heartbeat)
        self._cpu_wait: CpuWait | None = None  # the training thread's (made in steps())
        self._waited = Ewma()  # the CPU wait of a step's compute, smoothed
        self._waited_total = 0.0
        self._step_time = Ewma()  # logged as step_seconds: checkpoint_every auto's pace
        self._injected = 0.0
        self._last_step = cfg.start_step
        self._saved_at = None
        self.step = cfg.start_step  # the step the loop is on (report and update's default)
        self._loop_started: float | None = None
        self._loop_ended = False  # steps() ran to its end (the segment's, or a drain's)
        self._closed = False
        self._chaos.at_startup()
        self._heartbeat.start()
        self._responder.start()
        self._evidence.start()
        if rank == 0:
            self._publisher()  # opens the tracking store beside the loop, long before a save
            self._heartbeat.after_each_write(self._send_stalled_metrics)

    # -- where this segment starts and ends ------------------------------------------

    @property
    def start_step(self) -> int:
        """Return the first step this attempt trains (the resume point)."""
        return self.cfg.start_step

    @property
    def end_step(self) -> int:
        """Return the step this segment ends at (exclusive)."""
        return self.cfg.end_step

    @property
    def total_steps(self) -> int:
        """Return the job's last step (its ``total_steps``): the end of its last segment."""
        return self.cfg.job_steps

    @property
    def world_size(self) -> int:
        """Return the number of ranks."""
        return self.cfg.world_size

    @property
    def seed(self) -> int:
        """Return the job's seed (from the spec)."""
        return self.cfg.seed

    @property
    def job_config(self) -> dict[str, Any]:
        """Return the spec's ``model``, ``data`` and ``optimizer`` sections (for examples)."""
        return {"model": self.cfg.model, "data": self.cfg.data, "optimizer": self.cfg.optimizer}

    @property
    def placement(self) -> RankDevice:
        """Return where this rank computes: backend, device, DDP arguments (set up once)."""
        if self._placement is None:
            self._placement = setup_rank_device(
                self.cfg.backend, local_rank=self.local_rank,
                local_world_size=self.cfg.ranks_per_node, deterministic=self.cfg.deterministic)
        return self._placement

    def init_process_group(self) -> None:
        """Join the job's process group (env://, the spec's backend and collective timeout).

        A rank other than 0 first waits for rank 0's store to listen: torch's store
        client, refused, would sleep a second before trying again (see
        :mod:`relay_train.rendezvous`).
        """
        if self.rank != 0 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            wait_for_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           min(MAX_WAIT_SECONDS, self.cfg.collective_timeout_seconds))
        dist.init_process_group(
            self.backend, init_method="env://", rank=self.rank, world_size=self.world_size,
            timeout=timedelta(seconds=self.cfg.collective_timeout_seconds),
        )
        self.startup.mark("rendezvous")

    # -- the loop ---------------------------------------------------------------------

    def steps(self) -> Iterator[int]:
        """Yield this attempt's steps; stop early when Relay drains the attempt.

        With ``run_on_to`` the steps go on past ``end_step`` as long as a later
        segment's task adopts the workload (see :mod:`relay_train.boundary`).
        """
        self._heartbeat.beat(step=self.start_step)
        self._loop_started = time.perf_counter()
        if self._cpu_wait is None:
            self._cpu_wait = CpuWait()  # this thread's: the one that trains
            self._heartbeat.watch_cpu_wait(self._cpu_wait.seconds)
        step = self.start_step
        while True:
            resumed = time.perf_counter()
            self._bounds.poll()
            if step >= self._bounds.limit and not self._bounds.agree(step, self.device):
                self._loop_ended = True
                return
            self._follow_adoption(step)
            if self.rank == 0 and step in self.cfg.boundaries and step > self.start_step:
                agreed = time.perf_counter() - resumed
                self._bounds.record(step, self._stall, agreed, self._await_published(step))
            stop_at = self._drain.stop_at()
            if stop_at is not None and step >= stop_at:
                if step == stop_at:
                    self._checkpoint_drained(step)
                log.warning("rank %d drained at step %d", self.rank, step)
                self._loop_ended = True
                return
            self._chaos.before_step(step)
            self._phases.compute()
            self._clock.clear()
            self._clock["started"] = time.perf_counter()
            self._mark_wait("wait_started")
            self._injected = self._chaos.delay(step, self._natural.value or 0.0)
            self.step = step
            yield step
            step += 1

    def batches(self, loader: Any) -> Iterator[tuple[int, int, Any]]:  # noqa: ANN401
        """Yield (epoch, batch index, batch) for this attempt's steps: one batch a step.

        The epoch is ``step // len(loader)``; the sampler gets ``set_epoch``; a resume
        inside an epoch skips the trained batches by index (see :mod:`relay_train.batches`).
        """
        return epoch_batches(loader, self.steps(), seed=self.seed,
                             expected_per_epoch=self.cfg.steps_per_epoch)

    def _compute_wait(self) -> tuple[float, float] | None:
        """Return the CPU wait of this step's compute for the heartbeat (smoothed, and every
        step's added up; relay_train.cpu_wait), or None where it is not known."""
        clock = self._clock
        start = clock.get("wait_started")
        end = clock.get("wait_compute_done")
        if end is None:  # no collective marked the end of compute: the step is compute
            end = self._cpu_wait.seconds() if self._cpu_wait is not None else None
        if start is None or end is None:
            return None
        self._waited_total += end - start
        return self._waited.add(end - start), self._waited_total

    @contextlib.contextmanager
    def update(self, step: int | None = None) -> Iterator[None]:
        """Hold the rescue lock around the weight update of ``step`` (default: the loop's)."""
        step = self.step if step is None else step
        with self._training.lock:
            yield
            self._training.completed = step + 1

    def report(self, step: int | None = None, *, loss: float | None = None,
               samples: int = 0) -> None:
        """Report ``step`` (default: the loop's) done: heartbeat, metrics, and a checkpoint
        when one is due."""
        step = self.step if step is None else step
        if loss is not None:
            corrupted = float(self._chaos.corrupt_loss(step, loss))
            if math.isfinite(loss) and not math.isfinite(corrupted):
                self._poison_tracked()
            loss = corrupted
        done = time.perf_counter()
        started = self._clock.get("started", done)
        computed = self._clock.get("compute_done", done) - started
        if step >= self.start_step + WARMUP_STEPS:
            self._natural.add(computed - self._injected)
        rate = self._rate.add(samples * self.world_size / max(done - started, 1e-9))
        step_time = self._step_time.add(done - started)
        self._compute_total += computed
        self._heartbeat.beat(step=step + 1, compute_seconds=self._compute.add(computed),
                             samples_per_second=rate, loss=loss,
                             compute_total=self._compute_total, step_seconds=step_time,
                             cpu_wait=self._compute_wait())
        self._last_step = step + 1
        newly_poisoned = loss is not None and not math.isfinite(loss) and self._training.finite
        if newly_poisoned:
            self._training.finite = False
            self._heartbeat.flush_now()  # the first rank to report it is the culprit
        if step == self.start_step:
            self._first_step(step)
        tracks = self._state_fn is not None or bool(self._objects)
        if self.rank != 0:
            if tracks and self.checkpoint_due(step + 1):
                self.save(step + 1)  # offers this rank's RNG states to rank 0's checkpoint
            return
        if loss is not None:
            self._metrics.add(step + 1, {"loss": loss, "samples_per_second": rate,
                                         "step_seconds": step_time})
        if tracks and self.checkpoint_due(step + 1):
            self._checkpoint(step + 1, loss)
        elif self._metrics.due(time.monotonic()):
            self._metrics.flush()

    def close(self) -> None:
        """Finish: publish every pending checkpoint, write the result, stop the threads."""
        if self._closed:
            return
        self._closed = True
        loop_ended_at = time.time()
        self._responder.close()
        self._evidence.close()
        if self._dcp is not None:
            self._dcp.close()
        if self._checkpointer is not None:
            self._metrics.flush()
            self._checkpointer.close()
        if self.rank == 0 and self._loop_started is not None:
            seconds = time.perf_counter() - self._loop_started
            steps = self._last_step - self.start_step
            result = {"steps": steps, "loop_seconds": seconds,
                      "steps_per_second": steps / seconds if seconds > 0 else 0.0,
                      "loop_ended_at": loop_ended_at, "published_at": time.time()}
            (self.cfg.root / RESULT_FILE).write_text(json.dumps(result))
        self._heartbeat.close()
        keep_ddp_alive()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- internals ----------------------------------------------------------------------

    def _checkpoint_drained(self, step: int) -> None:
        """Checkpoint the drain's step if :meth:`report` of the step before did not: the
        drain came after it looked (the request arrives at any time). Relay takes the ranks'
        end as the drained checkpoint published; without this the retry resumed from an
        older one while the decision counted 0 lost steps (seen on Slurm)."""
        tracks = self._state_fn is not None or bool(self._objects)
        if step == self.start_step or self._saved_at == step or not tracks:
            return
        if self.rank == 0:
            self._checkpoint(step, None)
        else:
            self.save(step)  # offers this rank's RNG states to rank 0's checkpoint

    def _first_step(self, step: int) -> None:
        # Say at once that this rank is past start-up: a rank dying before the next
        # heartbeat interval is then a crash, not a launch failure (fast steps).
        self._heartbeat.flush_now()
        self.startup.mark("first step")
        log.info("rank %d productive after %s", self.rank, self.startup.summary())
        if self.rank == 0:  # when the attempt became productive (time to resume)
            first = {"step": step + 1, "at": time.time(), "node": self.node,
                     "spawned_at": self.startup.origin, "startup": self.startup.phases}
            (self.cfg.root / FIRST_STEP_FILE).write_text(json.dumps(first))



_SESSION: Session | LocalSession | None = None


def init(*, total_steps: int | None = None, epochs: int | None = None,
         checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None,
         seed: int = 0) -> Session | LocalSession:
    """Return this rank's session (made once per process).

    Under Relay (``RELAY_LAUNCH`` set by its node agent) a :class:`Session` of the
    job's segment, and the arguments are not used: the job spec decides. Otherwise a
    :class:`~relay_train.local.LocalSession` (plain ``torchrun``, or one process): the
    run's length from ``total_steps`` (or ``epochs`` x ``len(loader)``), checkpoints
    in ``checkpoint_dir`` every ``checkpoint_every`` steps, resumed from the newest.
    """
    global _SESSION
    if _SESSION is None:
        launch = os.environ.get(ENV_LAUNCH)
        if not launch:
            _SESSION = LocalSession(total_steps=total_steps, epochs=epochs,
                                    checkpoint_dir=checkpoint_dir, seed=seed,
                                    checkpoint_every=checkpoint_every or DEFAULT_CHECKPOINT_EVERY)
            return _SESSION
        cfg = LaunchConfig.read(Path(launch))
        asked = total_steps or (epochs * cfg.steps_per_epoch if epochs else 0)
        if asked and asked != cfg.job_steps:
            log.warning("relay_train.init: the script asks for %d steps, the job spec for %d; "
                        "under Relay the spec decides", asked, cfg.job_steps)
        _SESSION = Session(cfg, int(os.environ["RANK"]), os.environ[ENV_NODE])
    return _SESSION


def current() -> Session | LocalSession | None:
    """Return the session :func:`init` made in this process, if any."""
    return _SESSION


def seed_step(seed: int, step: int, rank: int) -> int:
    """Seed torch and Python's RNGs as a function of (seed, step, rank); return the seed.

    Opt-in determinism: data order and dropout that depend only on these three
    survive any resume unchanged.
    """
    import random

    from relay_train.examples.data import mix_seed

    value = mix_seed(seed, step, rank)
    torch.manual_seed(value)
    random.seed(value)
    return value
