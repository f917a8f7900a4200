"""The hang threshold derived from the job's own observed step time (NVRx-style).

NVIDIA's resiliency extension sets its timeouts as a safety factor over the
iterations it has seen. Relay does the same for a ``hang`` of one rank (stuck in
compute while the others wait for it) when the policy's
``detection.derive_hang_timeout`` section is present::

    hang threshold = heartbeat lag + safety_factor x the p95 step time,
                     held within [min, detection.hang_timeout]

- a step-time sample: at each poll, the median over the ranks of each rank's
  mean step time since its previous record, less the time its compute waited for a
  CPU (the heartbeat's ``cpu_wait_total``; the hang rule likewise judges a rank's time
  in compute less its ``phase_cpu_wait``: on a loaded host neither is a stall); one
  sample per poll (in data-parallel training the ranks step in lockstep, and a window
  of per-rank samples would shrink with the world size - 120 of them are a tenth of one
  poll at 1,024 ranks);
- the p95 step time: the 95th percentile (nearest rank) of the last
  :data:`WINDOW` samples, counted only after ``warmup_steps`` steps (start-up and
  the first steps after a resume are slow). Not the single slowest: one slow
  interval - a moment of CPU contention - would hold the threshold at its ceiling
  for the whole window. With fewer than 20 samples the p95 *is* the slowest, so a
  young estimate errs towards the ceiling; slowness that recurs in more than 5%
  of the polls still lifts it;
- intervals in which any rank was seen checkpointing are left out: the ranks wait
  for rank 0's snapshot (or for a later segment's task to adopt the workload),
  which is not a step, and a checkpoint that stalls has its own
  ``checkpoint_timeout``;
- the heartbeat lag: one ``heartbeat_interval``, the most a record can be behind
  the rank (the watcher reads the phase a rank was in when it last wrote);
- the policy's ``hang_timeout`` stays the ceiling, and the threshold until enough
  steps are seen: a derived threshold only ever detects sooner. Every rank busy at
  once for long (an evaluation pass) is still judged on ``hang_timeout`` itself.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from relay.watch.observation import StepSeen
from relay_train.protocol.heartbeat import Heartbeat, Phase

WINDOW = 120  # polls (60 s at the default poll_interval) the step-time quantile is taken over
QUANTILE = 0.95  # of the step-time samples: above jitter, below a rare stall
_CHECKPOINT = Phase.CHECKPOINT.value  # (an enum member's .value costs a call per rank)


@dataclass(frozen=True)
class HangLimit:
    """The hang threshold in force, and how it came about (for the fault's evidence)."""

    seconds: float
    how: str

    def describe(self) -> str:
        """Return e.g. ``hang_timeout 1.2s, derived: ...``."""
        return f"hang_timeout {self.seconds:.3g}s" + (f", {self.how}" if self.how else "")


def nearest_rank(values: list[float], quantile: float) -> float:
    """Return the ``quantile`` of ``values`` by the nearest-rank method (a value seen)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(quantile * len(ordered)) - 1, 0)]


class StepTimes:
    """Watch heartbeats for the job's step time; answer the hang threshold in force."""

    def __init__(self) -> None:
        self._last: dict[int, StepSeen] = {}  # rank -> its step, the wall clock it was seen at
        self._first_step: int | None = None
        self._samples: deque[float] = deque(maxlen=WINDOW)
        self._checkpointed: set[int] = set()  # ranks whose open interval saw a checkpoint

    def observe(self, beats: dict[int, Heartbeat], warmup_steps: int) -> None:
        """Fold in one poll's heartbeats: one sample, the ranks' median mean step time."""
        if not beats:
            return
        if self._first_step is None:
            self._first_step = min(b.step for b in beats.values())
        checkpointing = any(b.phase == _CHECKPOINT for b in beats.values())
        checkpointed, last_of = self._checkpointed, self._last  # (8,192 ranks a poll: hoisted)
        if checkpointing:
            checkpointed.update(beats)
        warm = self._first_step + warmup_steps
        times: list[float] = []
        for rank, beat in beats.items():
            # The rank's clock less its compute's waits for a CPU (relay_train.cpu_wait): a
            # step's time is then what the step took had the host not been loaded.
            step, last, at = beat.step, last_of.get(rank), beat.wall_clock - (
                beat.cpu_wait_total or 0.0)
            if last is None:
                last_of[rank] = StepSeen(step, at)
                continue
            if step == last.step:
                continue
            if step > last.step and at > last.at:
                if last.step >= warm and rank not in checkpointed:
                    times.append((at - last.at) / (step - last.step))
                if not checkpointing:  # a checkpoint going on taints the next interval
                    checkpointed.discard(rank)
            last.step, last.at = step, at
        if times:
            self._samples.append(statistics.median(times))

    @property
    def step_time(self) -> float | None:
        """Return the p95 step time over the window (None before warm-up)."""
        return nearest_rank(list(self._samples), QUANTILE) if self._samples else None

    def hang_limit(self, ceiling: float, heartbeat_interval: float, safety_factor: float,
                   floor: float) -> HangLimit:
        """Return the threshold: derived within [floor, ceiling], or the ceiling until known."""
        step = self.step_time
        if step is None:
            return HangLimit(ceiling, "")
        derived = heartbeat_interval + safety_factor * step
        seconds = min(max(derived, floor), ceiling)
        held = " (held at its min)" if derived < floor else (
            " (held at the policy's hang_timeout)" if derived > ceiling else "")
        return HangLimit(seconds, f"derived: {heartbeat_interval:g}s heartbeat lag + "
                         f"{safety_factor:g} x {step:.3g}s p95 step over "
                         f"{len(self._samples)} polls, checkpoints left out{held}")
