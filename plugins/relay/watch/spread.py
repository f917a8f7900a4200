"""What the job's own figures say is normal: the slowness rules' thresholds adapt to it.

The hang threshold already derives from the job's step time (:mod:`relay.watch.steptime`).
The straggler and throughput rules do the same with the job's measured spread, so
the noise of a loaded machine (a rank that loses its core for a few slices, every rank
slower while other work runs) is not taken for a fault:

- **straggler ratio**: per poll after start-up, one sample - the highest compute ratio
  (a rank's compute over the others' median) among the ranks the rule does not
  suspect, and the peak of each slow run that ended without being called, once its
  rank has stayed under the ratio for :data:`CLEAN_POLLS` polls (a blip that went
  away is noise by definition). The ratio in force is
  ``1 + RATIO_MARGIN x (p95 of the last WINDOW samples - 1)``, never below the
  policy's ``ratio`` and never above :data:`MAX_RATIO`. A straggler's own ratios are
  never samples: while its run lasts it is held slow, and a run that ends and comes
  back within CLEAN_POLLS polls (a lasting straggler measured under the ratio now and
  then on a loaded host) was no blip - its peak is dropped, and its rank's ratios
  under the ratio meanwhile are not samples either (:attr:`RatioSpread.suspects`).
  Before that rule a 3x straggler measured at 1.2-3.3x on a loaded 2-core host
  taught the ratio its own peaks, the ratio rose to the cap in seven polls and the
  straggler was never called. On a steady job the samples are ~1.0 and the policy's
  ratio holds.
- **machine-wide slowdown**: per poll, the median compute of every stepping rank;
  its median over the window is the job's usual compute. A rank over the ratio whose
  *others* are themselves over the ratio x that usual figure is not a straggler: the
  whole machine (or job) slowed together - the throughput rule's business - and the
  rank is not judged until the usual figure has caught up with the new level (about
  half the window) or the others are back. A straggler never raises the others'
  compute (they wait for it in the collective, not in compute), so it is still seen.
- **a rank's work, not the host's queue**: the straggler rule compares each rank's
  compute *with a CPU*: its compute per step less the time its thread waited for one
  (the heartbeat's ``cpu_wait_seconds``, from the kernel's run-queue figures:
  :mod:`relay_train.cpu_wait`). On a host oversubscribed 2x, ranks' compute per step
  swung 16-110 ms from poll to poll while compute less that wait stayed 6-21 ms
  (``relay.tools.bench.cpu_wait_probe``); a
  straggler's sleep, a slow kernel or a throttled device are not waits for a CPU and
  count in full. A rank starved of CPU by other work on its own node is therefore not
  called a straggler by this rule: the job's throughput shows it.
- **the job's work slowed** (:class:`UsualWork`): on a loaded host the throughput floor
  in force sinks with the dips the CPU waits cause (to 0.36 of the baseline at ~10x
  load), below which a real slowdown hides. So the throughput rule has a second
  witness: the ranks' median compute with a CPU grew, against its usual figure while
  the baseline was measured, by enough to put the job below the *policy's* floor on
  its own (``added > (1 / floor - 1) x the usual step time``): every rank's work got
  slower, whatever the host's queue does.
- **throughput floor**: the job's low dips while its baseline is measured (and the
  dips that recovered before ``sustained`` since): the floor in force is
  ``min(floor, 1 - FLOOR_MARGIN x (1 - p5 / baseline))``, never below
  :data:`MIN_FLOOR_SHARE` x the policy's ``floor``.
"""

from __future__ import annotations

import statistics
from collections import deque

from relay.watch.steptime import WINDOW, nearest_rank
from relay_train.protocol.heartbeat import Heartbeat

RATIO_MARGIN = 1.25  # the ratio in force sits this far beyond the noise's p95 excess
# Never above, with room below 3x: a rank at 3x the others' compute is a straggler on any
# host (at a cap of 3.0, a 3x straggler measured just under 3x was missed at load ~3).
MAX_RATIO = 2.5
MIN_SAMPLES = 10  # polls before the spread counts (until then: the policy's figures)
CLEAN_POLLS = 6  # polls a rank stays under the ratio before its ended run's peak is noise
HIGH = 0.95  # the quantile of the ratio samples the noise is judged by
LOW = 0.05  # the quantile of the throughput samples the dips are judged by
FLOOR_MARGIN = 1.5  # the floor in force sits this far below the dips' depth
MIN_FLOOR_SHARE = 0.6  # the floor in force never drops below this share of the policy's
SAMPLED_RANKS = 256  # UsualWork's medians are taken over at most this many ranks


class RatioSpread:
    """The straggler ratio in force and the job's usual compute per step."""

    def __init__(self, ratio: float) -> None:
        self.policy_ratio = ratio
        self._ratios: deque[float] = deque(maxlen=WINDOW)
        self._medians: deque[float] = deque(maxlen=WINDOW)
        # rank -> (the peak of its slow run that ended, polls under the ratio since)
        self._ended: dict[int, tuple[float, int]] = {}
        self.ratio = ratio  # the ratio in force: updated by :meth:`add`

    @property
    def suspects(self) -> set[int]:
        """Return the ranks whose slow run ended less than CLEAN_POLLS polls ago."""
        return set(self._ended)

    def add(self, highest: float | None, median: float) -> None:
        """Fold in one poll: the highest ratio of the ranks not suspected (None: none),
        and the median compute per step of every stepping rank; fold in the peaks of
        the runs whose ranks have now stayed under the ratio CLEAN_POLLS polls."""
        if highest is not None:
            self._ratios.append(highest)
        if median > 0:
            self._medians.append(median)
        for rank, (peak, polls) in list(self._ended.items()):
            if polls + 1 < CLEAN_POLLS:
                self._ended[rank] = (peak, polls + 1)
            else:
                del self._ended[rank]
                self._ratios.append(peak)
        self._update()

    def ended(self, rank: int, peak: float) -> None:
        """Say ``rank``'s slow run ended without being called at ``peak``: noise, if the
        rank stays under the ratio CLEAN_POLLS polls."""
        self._ended[rank] = (peak, 0)

    def returned(self, rank: int) -> None:
        """Say ``rank`` is over the ratio again: its last run was no blip."""
        self._ended.pop(rank, None)

    def blip(self, peak: float) -> None:
        """Fold in the peak ratio of a slow run that went away."""
        self._ratios.append(peak)
        self._update()

    def _update(self) -> None:
        if len(self._ratios) < MIN_SAMPLES:
            return
        noise = nearest_rank(list(self._ratios), HIGH)
        self.ratio = max(self.policy_ratio, min(1.0 + RATIO_MARGIN * (noise - 1.0), MAX_RATIO))

    @property
    def usual_compute(self) -> float | None:
        """Return the job's usual median compute per step (None until enough polls)."""
        if len(self._medians) < MIN_SAMPLES:
            return None
        return statistics.median(self._medians)

    def machine_wide(self, others: float) -> bool:
        """Return whether the others' median compute ``others`` shows the whole machine
        slower than usual by the ratio in force (then a slow rank is not a straggler)."""
        usual = self.usual_compute
        return usual is not None and others > self.ratio * usual

    def describe(self) -> str:
        """Return how the ratio in force came about (for the fault's evidence)."""
        if self.ratio == self.policy_ratio:
            return f"ratio {self.ratio:g}"
        return (f"ratio {self.ratio:.2f} (the policy's {self.policy_ratio:g}, raised by the "
                f"job's own spread over {len(self._ratios)} polls)")


class RateSpread:
    """The throughput floor in force, from the job's own dips below its baseline."""

    def __init__(self, floor: float) -> None:
        self.policy_floor = floor
        self.floor = floor
        self._rates: deque[float] = deque(maxlen=WINDOW)

    def add(self, rate: float, baseline: float | None) -> None:
        """Fold in one poll's rate (``baseline``: the job's, once measured)."""
        self._rates.append(rate)
        if baseline is None or baseline <= 0 or len(self._rates) < MIN_SAMPLES:
            return
        depth = 1.0 - nearest_rank(list(self._rates), LOW) / baseline
        self.floor = max(min(self.policy_floor, 1.0 - FLOOR_MARGIN * depth),
                         MIN_FLOOR_SHARE * self.policy_floor)


def work(beat: Heartbeat) -> float:
    """Return a rank's compute per step with a CPU: its compute less the time its thread
    waited for one (the whole compute where the rank does not say)."""
    return max((beat.compute_seconds or 0.0) - (beat.cpu_wait_seconds or 0.0), 0.0)


class UsualWork:
    """The ranks' usual compute with a CPU and step time (measured with the throughput
    baseline), and whether their work has since slowed enough to sink the job below a
    floor by itself. Judged only where every rank says its CPU wait."""

    def __init__(self) -> None:
        self._work: list[float] = []
        self._steps: list[float] = []
        self.work: float | None = None  # the usual: the median of the polls' medians
        self.step: float | None = None
        self.now: float | None = None  # the last poll's median, once judged

    @staticmethod
    def _figures(active: list[Heartbeat]) -> tuple[float, float] | None:
        """Return the poll's median work and median step time (None: not every rank says),
        over at most :data:`SAMPLED_RANKS` ranks spread evenly over the job: a job-wide
        median, not a rank's figure, at a thirtieth of the cost at 8,192 ranks."""
        ranks = active[::max(len(active) // SAMPLED_RANKS, 1)]
        if any(b.cpu_wait_seconds is None or b.step_seconds is None for b in ranks):
            return None
        return (statistics.median_high([work(b) for b in ranks]),
                statistics.median_high([b.step_seconds or 0.0 for b in ranks]))

    def sample(self, active: list[Heartbeat]) -> None:
        """Fold in one poll while the baseline is measured."""
        figures = self._figures(active)
        if figures is not None:
            self._work.append(figures[0])
            self._steps.append(figures[1])

    def settle(self) -> None:
        """Fix the usual figures (once the baseline is measured)."""
        if len(self._work) >= 2:
            self.work, self.step = statistics.median(self._work), statistics.median(self._steps)

    def slowed(self, active: list[Heartbeat], floor: float) -> bool:
        """Return whether the work added per step since the baseline would alone put the
        job below ``floor`` of it."""
        figures = self._figures(active) if self.work is not None else None
        if figures is None or self.step is None or self.work is None:
            self.now = None
            return False
        self.now = figures[0]
        return self.now - self.work > (1.0 / floor - 1.0) * self.step

    def describe(self) -> str:
        """Return the figures behind :meth:`slowed` (for the fault's summary)."""
        if self.now is None or self.work is None or self.step is None:
            return ""
        return (f"the ranks' compute with a CPU rose from {self.work:.3f}s to {self.now:.3f}s "
                f"a step (usual step {self.step:.3f}s)")

    def evidence(self) -> dict[str, float]:
        """Return the figures behind :meth:`slowed` as evidence fields."""
        if self.now is None or self.work is None or self.step is None:
            return {}
        return {"work_seconds": round(self.now, 4), "usual_work_seconds": round(self.work, 4),
                "usual_step_seconds": round(self.step, 4)}
