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
from collections import deque
from dataclasses import dataclass

import numpy as np

from relay.watch.columns import RankArrays, RankColumns, code_of
from relay_train.protocol.heartbeat import Phase

WINDOW = 120  # polls (60 s at the default poll_interval) the step-time quantile is taken over
QUANTILE = 0.95  # of the step-time samples: above jitter, below a rare stall
_CHECKPOINT = code_of(Phase.CHECKPOINT.value)


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
        # per rank: its step and clock when last seen moving on, whether its open interval
        # saw a checkpoint (arrays indexed by rank: relay.watch.columns)
        self._last = RankArrays(step=(np.int64, 0), at=(np.float64, 0.0),
                                checkpointed=(np.bool_, False))
        self._first_step: int | None = None
        self._samples: deque[float] = deque(maxlen=WINDOW)

    def observe(self, cols: RankColumns, warmup_steps: int) -> None:
        """Fold in one poll's heartbeats: one sample, the ranks' median mean step time."""
        if not len(cols):
            return
        if self._first_step is None:
            self._first_step = int(cols.step.min())
        last = self._last
        last.fit(cols.rank)
        rank, step = cols.rank, cols.step
        # The rank's clock less its compute's waits for a CPU (relay_train.cpu_wait): a
        # step's time is then what the step took had the host not been loaded.
        at = cols.wall_clock - cols.cpu_wait_total
        checkpointing = bool((cols.phase == _CHECKPOINT).any())
        checkpointed = last["checkpointed"]
        if checkpointing:
            checkpointed[rank] = True
        seen, last_step, last_at = last.seen[rank], last["step"][rank], last["at"][rank]
        moved = seen & (step != last_step)
        on = moved & (step > last_step) & (at > last_at)
        sampled = on & (last_step >= self._first_step + warmup_steps) & ~checkpointed[rank]
        times = (at[sampled] - last_at[sampled]) / (step[sampled] - last_step[sampled])
        if not checkpointing:  # a checkpoint going on taints the next interval
            checkpointed[rank[on]] = False
        fresh = moved | ~seen
        last["step"][rank[fresh]], last["at"][rank[fresh]] = step[fresh], at[fresh]
        last.seen[rank] = True
        if len(times):
            self._samples.append(float(np.median(times)))

    def last_seen(self) -> dict[int, tuple[int, float]]:
        """Return rank -> its step and clock when last seen moving on."""
        return self._last.by_rank("step", "at")

    def checkpointed(self) -> set[int]:
        """Return the ranks whose open interval saw a checkpoint."""
        return set(self._last.by_rank("step", where=self._last["checkpointed"]))

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
