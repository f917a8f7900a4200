"""Segment boundaries without a restart: the ranks train on past their segment's end.

A workload launched for segment *k* with ``run_on_to`` set trains past its
segment's end (``end_step``): it publishes the boundary checkpoint there
asynchronously, like any other, and keeps training towards ``run_on_to`` (the
next segment's end). The next segment's task *adopts* it by writing
``adopt.json`` into the workload's folder (see :mod:`relay.launchers.local.adopt`): from then
on checkpoints go to the adopting attempt's MLflow run, chaos faults see the
adopting segment and attempt, and ``run_on_to`` moves one segment further.

A checkpoint at a later segment's end belongs to that segment's attempt, so
before publishing it rank 0 waits (at most ``adopt_wait_seconds``) until that
segment's task has adopted the workload (:meth:`BoundaryKeeper.await_owner`);
this is also the job's last step, so every segment has an attempt of its own,
however fast its steps are. Without an adoption in time the checkpoint goes to
the earlier attempt's run.

Rank 0 goes past a boundary only once its checkpoint is in MLflow (waiting at most
:data:`PUBLISH_WAIT_SECONDS`): a node that freezes just after the boundary, while
that upload is still running, would otherwise leave the finished segment without
its checkpoint, and its task could only fail and relaunch the same segment.

Every rank must stop at the same step, so the limit only changes at the limit
itself, where the ranks agree: rank 0 reads ``adopt.json`` (waiting for it at
most ``adopt_wait_seconds`` in all when nobody has adopted the workload yet) and
broadcasts the new limit; with none, every rank finishes there (its checkpoint
is published), so a workload whose next task never comes does not hold its
nodes for longer than one segment plus that wait. Imports torch and the
standard library only.
"""

from __future__ import annotations

import bisect
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from relay_train.protocol.launch import ADOPT_FILE, BOUNDARIES_FILE, LaunchConfig

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
PUBLISH_WAIT_SECONDS = 30.0  # an MLflow outage stalls a boundary this long at most


@dataclass(frozen=True)
class Adoption:
    """A later segment's task took this workload over (the content of ``adopt.json``)."""

    run_on_to: int
    run_id: str
    segment: int
    attempt: int

    @classmethod
    def read(cls, path: Path) -> Adoption | None:
        """Parse ``adopt.json``; None while it is missing or being written."""
        try:
            raw = json.loads(path.read_text())
            return cls(int(raw["run_on_to"]), str(raw["run_id"]), int(raw["segment"]),
                       int(raw["attempt"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


class BoundaryKeeper:
    """Where this workload may train to, and which segment attempt each step belongs to."""

    def __init__(self, cfg: LaunchConfig, rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.path = cfg.root / ADOPT_FILE
        self.run_on = cfg.run_on_to is not None and cfg.run_on_to > cfg.end_step
        self.limit = int(cfg.run_on_to) if self.run_on else cfg.end_step
        self.total = max([cfg.end_step, *cfg.boundaries])
        self.adoption: Adoption | None = None
        self._seen: tuple[int, int] | None = None
        self._waited: tuple[int, float] | None = None  # (step, seconds) of await_owner

    def checkpoint_steps(self) -> set[int]:
        """Return the steps a checkpoint is always published at (segment ends, the limit)."""
        return {*self.cfg.boundaries, self.cfg.end_step, self.limit}

    def poll(self) -> Adoption | None:
        """Return a newly written adoption, if ``adopt.json`` changed (one ``stat`` a call)."""
        if not self.run_on:
            return None
        try:
            stat = self.path.stat()
        except OSError:
            return None
        key = (stat.st_mtime_ns, stat.st_size)
        if key == self._seen:
            return None
        found = Adoption.read(self.path)
        if found is None or found == self.adoption:
            return None
        self._seen, self.adoption = key, found
        log.info("rank %d: adopted by segment %d try %d (MLflow run %s); may train to step %d",
                 self.rank, found.segment, found.attempt, found.run_id, found.run_on_to)
        return found

    def where(self, step: int) -> tuple[int, int]:
        """Return (segment, attempt) that ``step`` belongs to, for chaos and logs."""
        segment = max(bisect.bisect_right(self.cfg.boundaries, step), self.cfg.segment)
        if segment == self.cfg.segment:
            return segment, self.cfg.attempt
        if self.adoption is not None and self.adoption.segment == segment:
            return segment, self.adoption.attempt
        return segment, 1  # past the segment's end, not adopted yet: that segment's first try

    def owner_pending(self, step: int) -> int | None:
        """Return the later segment that ends at ``step`` while no task of it has adopted
        this workload yet (None: the step is no such end, or its segment adopted it)."""
        if not self.run_on or step <= self.cfg.end_step or step not in self.cfg.boundaries:
            return None
        segment = self.cfg.boundaries.index(step)
        if self.adoption is not None and self.adoption.segment >= segment:
            return None
        return segment

    def await_owner(self, step: int) -> bool:
        """Rank 0, before checkpointing at a later segment's end: wait until that segment's
        task adopts this workload, so the checkpoint goes to its attempt run.

        Bounded by ``adopt_wait_seconds``; return whether it came. Without one the
        checkpoint goes to the earlier run and :meth:`agree` does not wait again.
        """
        segment = self.owner_pending(step)
        if segment is None:
            return True
        started = time.monotonic()
        self.poll()
        while self.owner_pending(step) is not None:
            if time.monotonic() - started >= self.cfg.adopt_wait_seconds:
                log.warning("rank %d: segment %d's task did not adopt this workload within "
                            "%gs of step %d; its checkpoint goes to the earlier attempt's run",
                            self.rank, segment, self.cfg.adopt_wait_seconds, step)
                break
            time.sleep(POLL_SECONDS)
            self.poll()
        self._waited = (step, time.monotonic() - started)
        return self.owner_pending(step) is None

    def agree(self, step: int, device: torch.device) -> bool:
        """At the limit: agree with every rank whether to go on; return True to go on."""
        if not self.run_on or step >= self.total:
            return False
        offer = self._offer() if self.rank == 0 else 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            value = torch.tensor([offer], dtype=torch.int64, device=device)
            dist.broadcast(value, src=0)
            offer = int(value.item())
        if offer <= self.limit:
            log.info("rank %d: not adopted by step %d; finishing here", self.rank, step)
            return False
        self.limit = offer
        if self.rank != 0:
            self.poll()  # rank 0 saw it: this rank's chaos and logs follow the same adoption
        return True

    def _offer(self) -> int:
        """Rank 0: the limit an adoption grants, waiting for one at most the bound."""
        waited_here = self._waited is not None and self._waited[0] == self.limit
        deadline = time.monotonic() + (0.0 if waited_here else self.cfg.adopt_wait_seconds)
        while True:
            self.poll()
            if self.adoption is not None and self.adoption.run_on_to > self.limit:
                return self.adoption.run_on_to
            if time.monotonic() >= deadline:
                return self.limit
            time.sleep(POLL_SECONDS)

    def record(self, step: int, stall: float, agreed: float, published: float = 0.0) -> None:
        """Rank 0: append what crossing the boundary at ``step`` cost the training loop
        (``agreed`` plus any wait for a late adoption before its checkpoint; ``published``:
        the wait until the boundary checkpoint was in MLflow)."""
        if self._waited is not None and self._waited[0] == step:
            agreed += self._waited[1]
        entry = {"step": step, "at": time.time(), "checkpoint_stall": round(stall, 4),
                 "agree": round(agreed, 4), "publish": round(published, 4),
                 "loop_cost": round(stall + agreed + published, 4),
                 "adopted_by": None if self.adoption is None else
                 {"segment": self.adoption.segment, "attempt": self.adoption.attempt}}
        with (self.cfg.root / BOUNDARIES_FILE).open("a") as out:
            out.write(json.dumps(entry) + "\n")
