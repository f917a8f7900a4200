"""The hang threshold derived from the job's own observed step time (NVRx-style).

NVIDIA's resiliency extension sets its timeouts as a safety factor over the
iterations it has seen. Relay does the same for a ``hang`` of one rank (stuck in
compute while the others wait for it) when the policy's
``detection.derive_hang_timeout`` section is present::

    hang threshold = heartbeat lag + safety_factor x the slowest step seen,
                     held within [min, detection.hang_timeout]

- the slowest step seen: the longest mean step time between two heartbeats of
  any rank over the last :data:`WINDOW` such intervals, counted only after
  ``warmup_steps`` steps (start-up and the first steps after a resume are slow);
- the heartbeat lag: one ``heartbeat_interval``, the most a record can be behind
  the rank (the watcher reads the phase a rank was in when it last wrote);
- the policy's ``hang_timeout`` stays the ceiling, and the threshold until enough
  steps are seen: a derived threshold only ever detects sooner. Every rank busy at
  once for long (an evaluation pass) is still judged on ``hang_timeout`` itself.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from relay_train.heartbeat import Heartbeat

WINDOW = 120  # heartbeat intervals (of all ranks) the slowest step is taken over


@dataclass(frozen=True)
class HangLimit:
    """The hang threshold in force, and how it came about (for the fault's evidence)."""

    seconds: float
    how: str

    def describe(self) -> str:
        """Return e.g. ``hang_timeout 1.2s, derived: ...``."""
        return f"hang_timeout {self.seconds:.3g}s" + (f", {self.how}" if self.how else "")


class StepTimes:
    """Watch heartbeats for the job's step time; answer the hang threshold in force."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, float]] = {}  # rank -> (step, wall clock)
        self._first_step: int | None = None
        self._samples: deque[float] = deque(maxlen=WINDOW)

    def observe(self, beats: dict[int, Heartbeat], warmup_steps: int) -> None:
        """Fold in one poll's heartbeats (each rank's mean step time since its last record)."""
        if not beats:
            return
        low = min(b.step for b in beats.values())
        if self._first_step is None:
            self._first_step = low
        for rank, beat in beats.items():
            last = self._last.get(rank)
            if last is not None and beat.step > last[0] and beat.wall_clock > last[1]:
                if last[0] >= self._first_step + warmup_steps:
                    self._samples.append((beat.wall_clock - last[1]) / (beat.step - last[0]))
            if last is None or beat.step != last[0]:
                self._last[rank] = (beat.step, beat.wall_clock)

    @property
    def slowest(self) -> float | None:
        """Return the slowest step seen (None before warm-up)."""
        return max(self._samples) if self._samples else None

    def hang_limit(self, ceiling: float, heartbeat_interval: float, safety_factor: float,
                   floor: float) -> HangLimit:
        """Return the threshold: derived within [floor, ceiling], or the ceiling until known."""
        slowest = self.slowest
        if slowest is None:
            return HangLimit(ceiling, "")
        derived = heartbeat_interval + safety_factor * slowest
        seconds = min(max(derived, floor), ceiling)
        held = " (held at its min)" if derived < floor else (
            " (held at the policy's hang_timeout)" if derived > ceiling else "")
        return HangLimit(seconds, f"derived: {heartbeat_interval:g}s heartbeat lag + "
                         f"{safety_factor:g} x {slowest:.3g}s slowest step{held}")
