"""The performance rules: one rank slower than the rest (straggler), the whole job slower.

Both judge only ranks that are stepping (the detector's ``_active``) and keep the
little state "sustained" and "baseline" need.

**Straggler: how long to wait depends on what the slowness costs.** In data-parallel
training every rank waits for the slowest at each collective, so each step a rank
finishes with ``extra`` seconds more compute than the others' median costs the job
``extra`` seconds. The rule adds that up (excess compute x steps finished, at most
the time that passed) over the polls a rank stays above ``ratio`` and fires once
the job has lost ``lost_seconds`` - but only after :data:`MIN_SLOW_STEPS` distinct
steps have been seen over the ratio, so one jittery step (carried for a while by
the rank's smoothed compute time) is not enough. ``sustained`` stays the upper
bound: a rank over ``ratio`` that long always fires, as it did before
``lost_seconds`` existed.

**The excess is counted exactly where the ranks say their total compute time**
(the heartbeat's ``compute_total``): between two polls, a rank's excess is its
compute over the steps it finished minus the others' median over theirs. The
smoothed per-step figure, which reaches a sudden slowdown only over several steps,
still decides *whether* a rank is over the ratio (one jittery step does not put it
there), but no longer undercounts what it cost; and the interval in which a rank
first went over the ratio counts too (its steps were slow already). Ranks that do
not report the total (an older worker) are counted on the smoothed figure.

When compute is the whole step, a rank at ``r`` x the others' compute costs the
job ``1 - 1/r`` of each second: a 40x straggler ~97% (called after ~1 s), a 1.6x
one ~38% (~2.7 s). Where the collective or the input pipeline takes most of the
step, the same ratio costs less and the rule waits longer - up to ``sustained`` -
instead of assuming the worst. Time is credited only as steps finish, so the
frozen figures of a stalled job (a hang on its way) add nothing.

**Start-up is not judged.** Nothing is counted until the ranks have been stepping
for ``sustained`` (per watcher), unless the watcher knows they were past start-up
before it looked (``settled``: a workload adopted at a segment boundary, stepping
for a whole segment already; judging its first seconds too means a straggler just
after a boundary is not called ``sustained`` late).
The first seconds of a workload are uneven on a shared host: rank 0 opens its
MLflow client and uploads its first checkpoint beside its steps, while the Airflow
task that launched it is still deferring. On this 2-core machine that alone made
rank 0 1.5x the others for a second or two, and a straggler was called 3 s into a
fault-free run. A rank slow from its first step is called ``sustained`` later.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from relay.core.faults import Fault, FaultKind
from relay.policy.model import MIN_SLOW_STEPS, StragglerDetection, ThroughputDetection
from relay.watch.columns import RankArrays, RankColumns
from relay.watch.spread import RateSpread, RatioSpread, UsualWork, work
from relay_train.protocol.heartbeat import Heartbeat

GRACE_POLLS = 1  # polls under the ratio a slow run survives (its clock stopped meanwhile)


def leave_one_out(ordered: list[float]) -> Callable[[float], float]:
    """Return ``value -> the median of ordered (sorted) with one occurrence of value left
    out``, O(1) a value: the median of the others is one of three figures, picked by where
    ``value`` falls around the middle (what a bisection would find, without one per rank:
    8,192 ranks are judged every poll).
    """
    n = len(ordered) - 1  # the others' count
    m = n // 2
    if n % 2:
        low, high = ordered[m], ordered[m + 1]
        return lambda value: low if low < value else high
    # even: the mean of the others' two middle values, ordered[m-1..m+1] less the one left out
    below, mid, above = ordered[m - 1], ordered[m], ordered[m + 1]
    left_high, left_mid, left_low = (below + mid) / 2, (below + above) / 2, (mid + above) / 2

    def median(value: float) -> float:
        if mid < value:
            return left_high
        return left_mid if below < value else left_low

    return median


def median_without(ordered: list[float], value: float) -> float:
    """Return the median of ``ordered`` (sorted) with one occurrence of ``value`` left out."""
    return leave_one_out(ordered)(value)


@dataclass
class Sustained:
    """How long a condition has held, per key, counting only while it is judged: a key
    left unjudged for a while (:meth:`pause`) has its clock stopped from its last
    judgement to its next, so a pause is never taken for the condition going on."""

    since: dict[object, float] = field(default_factory=dict)
    last: dict[object, float] = field(default_factory=dict)  # key -> its last judgement
    paused: set[object] = field(default_factory=set)

    def hold(self, key: object, condition: bool, now: float) -> float:
        """Return for how long ``condition`` has held for ``key`` (0 when it does not)."""
        if not condition:
            self.since.pop(key, None)
            self.last.pop(key, None)
            self.paused.discard(key)
            return 0.0
        if key in self.paused:  # (only a key with a clock is ever paused)
            self.since[key] += now - self.last[key]  # the pause did not count
        self.paused.discard(key)
        self.last[key] = now
        return now - self.since.setdefault(key, now)

    def pause(self, key: object) -> None:
        """Say ``key`` is not judged now: its clock stands still until it is again."""
        if key in self.since:
            self.paused.add(key)

    def held(self, key: object, now: float) -> float:
        """Return for how long the condition has held for ``key``, without updating it."""
        if key in self.paused:
            return self.last[key] - self.since[key]
        return now - self.since.get(key, now)


@dataclass
class _SlowRun:
    """One rank's unbroken run over the ratio: what it has cost the job, and its evidence."""

    last_seen: float
    last_step: int
    steps: int = 1  # distinct steps seen over the ratio
    under: int = 0  # polls under the ratio since it was last over (see GRACE_POLLS)
    lost: float = 0.0  # seconds the job waited on this rank
    peak: float = 0.0  # the highest ratio seen in the run


class StragglerRule:
    """Fire when a slow rank has cost the job ``lost_seconds`` (or stayed slow ``sustained``)."""

    def __init__(self, rule: StragglerDetection, settled: bool = False) -> None:
        self.rule = rule
        self._held = Sustained()
        self._runs: dict[int, _SlowRun] = {}
        # When two ranks were first seen stepping; -inf: past start-up before we looked.
        self._stepping_since: float | None = -math.inf if settled else None
        # per rank: its step, compute_total less CPU waits and when, at the last poll that
        # moved it on: the exact excess (above); arrays indexed by rank (relay.watch.columns)
        self._totals = RankArrays(step=(np.int64, 0), total=(np.float64, 0.0),
                                  when=(np.float64, 0.0))
        self._spread = RatioSpread(rule.ratio)  # the ratio in force (relay.watch.spread)

    @property
    def ratio(self) -> float:
        """Return the ratio in force: the policy's, raised by the job's own spread."""
        return self._spread.ratio

    def _interval_excess(self, cols: RankColumns, now: float
                         ) -> Callable[[int], float | None]:
        """Return ``rank ->`` its compute beyond the others' median over the steps it
        finished since the last poll (at most the time that passed; None where a figure is
        unknown); remember this poll's totals for the next. Over the stepping ranks'
        columns; only the ranks over the ratio are asked."""
        totals = self._totals
        totals.fit(cols.rank)
        rank, step = cols.rank, cols.step
        total = cols.compute_total - cols.cpu_wait_total  # the work's alone (spread.work)
        seen = totals.seen[rank]
        last_step, last_total = totals["step"][rank], totals["total"][rank]
        since = totals["when"][rank]
        moved = ~np.isnan(total) & ~(seen & (step == last_step))
        on = moved & seen & (step > last_step) & (total >= last_total)
        per_step = (total[on] - last_total[on]) / (step[on] - last_step[on])
        steps, since = step[on] - last_step[on], since[on]
        totals["step"][rank[moved]], totals["total"][rank[moved]] = step[moved], total[moved]
        totals["when"][rank[moved]], totals.seen[rank[moved]] = now, True
        if len(per_step) < 2:
            return lambda _rank: None
        others = leave_one_out(sorted(per_step.tolist()))
        row_of = np.full(len(totals.seen), -1, np.int64)
        row_of[rank[on]] = np.arange(len(per_step))

        def excess(of: int) -> float | None:
            i = int(row_of[of]) if 0 <= of < len(row_of) else -1
            if i < 0:
                return None
            p = float(per_step[i])
            return min(max(p - others(p), 0.0) * int(steps[i]), now - float(since[i]))

        return excess

    def totals(self) -> dict[int, tuple[int, float, float]]:
        """Return rank -> (step, compute_total less CPU waits, when) at its last move."""
        return self._totals.by_rank("step", "total", "when")

    def _track(self, beat: Heartbeat, extra: float, now: float,
               exact: float | None) -> _SlowRun:
        """Count what ``beat``'s rank cost the job since the last poll: ``exact`` where the
        totals say it, else ``extra`` (the smoothed excess) x the steps it finished."""
        run = self._runs.get(beat.rank)
        if run is None:
            # The interval it went over the ratio in was slow already: it counts.
            run = self._runs[beat.rank] = _SlowRun(last_seen=now, last_step=beat.step,
                                                   lost=exact or 0.0)
            return run
        if beat.step > run.last_step:  # each finished step kept the others waiting ``extra`` s
            run.lost += exact if exact is not None else min(
                extra * (beat.step - run.last_step), now - run.last_seen)
            run.steps += 1
        if beat.step != run.last_step:
            run.last_seen, run.last_step = now, beat.step
        return run

    def slow_ranks(self, now: float) -> list[int]:
        """Return the ranks half way to being called (a straggler on its way): over the
        ratio for MIN_SLOW_STEPS steps and half of ``lost_seconds`` lost, or for half of
        ``sustained``. A blip of a step or two under load is not one."""
        budget, half = self.rule.lost_seconds, self.rule.sustained / 2
        return sorted(r for r, run in self._runs.items() if run.steps >= MIN_SLOW_STEPS and (
            (budget is not None and run.lost >= budget / 2)
            or self._held.held(r, now) >= half))

    def _due(self, run: _SlowRun, held: float) -> bool:
        budget = self.rule.lost_seconds
        return held >= self.rule.sustained or (
            budget is not None and run.lost >= budget and run.steps >= MIN_SLOW_STEPS)

    def _judge(self, beat: Heartbeat, value: float, others: float, now: float,
               exact: float | None, due: list[tuple[float, float]],
               slow: list[Heartbeat]) -> float:
        """Judge one rank, its compute with a CPU ``value``, against the others' median
        ``others``: start, go on with or end its slow run (adding it to ``slow``, and its
        (lost, held) to ``due`` when it is due); return its ratio. A run survives
        :data:`GRACE_POLLS` polls under the ratio, its clock stopped and nothing counted: a
        straggler measured under the ratio for a poll on a loaded host goes on where it
        was."""
        rank, spread = beat.rank, self._spread
        ratio = value / others if others > 0 else 0.0
        over = ratio > spread.ratio
        if over and spread.machine_wide(others):
            self._held.pause(rank)  # the others slowed too: not this rank's doing
            return ratio
        run = self._runs.get(rank)
        if not over:
            if run is not None and run.under < GRACE_POLLS:
                run.under += 1
                run.last_seen, run.last_step = now, beat.step  # its steps now were not slow
                self._held.pause(rank)
                return ratio
            self._held.hold(rank, False, now)
            if self._runs.pop(rank, None) is not None:  # over for a while, then not: noise?
                spread.ended(rank, run.peak if run else ratio)
            return ratio
        spread.returned(rank)
        held = self._held.hold(rank, True, now)
        run = self._track(beat, value - others, now, exact)
        run.under = 0
        run.peak = max(run.peak, ratio)
        slow.append(beat)
        if self._due(run, held):
            due.append((run.lost, held))
        return ratio

    def _highest_under(self, ordered: list[float], median_of_others: Callable[[float], float],
                       active: list[Heartbeat]) -> float | None:
        """Return the highest ratio not over the ratio in force among the ranks neither
        in a slow run nor suspected (the spread's sample), found from the top."""
        runs, suspects = self._runs, self._spread.suspects
        left_out: Counter[float] = Counter()
        if runs or suspects:  # (no pass over the 8,192 ranks when none is left out)
            left_out.update(work(b) for b in active if b.rank in runs or b.rank in suspects)
        for value in reversed(ordered):
            if left_out[value] > 0:
                left_out[value] -= 1
                continue
            others = median_of_others(value)
            ratio = value / others if others > 0 else 0.0
            if ratio <= self._spread.ratio:
                return ratio
        return None

    def check(self, stepping: RankColumns, now: float) -> Fault | None:
        """Return a straggler fault once one is due (``stepping``: the stepping ranks)."""
        cols = stepping.subset(stepping.compute_seconds != 0.0)  # those that say a figure
        active = cols.beats
        judged = len(active) >= 2
        if self._held.since:  # (the set of 8,192 ranks only when a clock may need it)
            ranks = set(cols.rank.tolist()) if judged else set()
            for rank in [r for r in self._held.since if r not in ranks]:
                # Not stepping now (a boundary's publish, a node whose answer is late): how
                # long a rank has been over the ratio counts only while it is seen stepping,
                # or the first poll after a pause would find it "slow" for the whole pause.
                self._held.pause(rank)
        if not judged:
            return None
        exact = self._interval_excess(cols, now)
        if self._stepping_since is None:
            self._stepping_since = now
        if now - self._stepping_since < self.rule.sustained:
            return None  # start-up: nothing held, nothing lost yet
        works = cols.compute_seconds - cols.cpu_wait_seconds  # work(b), over the columns
        values = works.tolist()
        ordered = sorted(values)
        median_of_others = leave_one_out(ordered)
        spread, limit = self._spread, self._spread.ratio
        # A rank's ratio to the others' median rises with its compute (the others' median
        # can only fall as it grows), so the ranks over the ratio are those above the
        # highest compute that is not: found from the top, one step past the slow ranks.
        # Only those, and the ranks with a clock or a run to end, are looked at one by one.
        bound = -math.inf  # compute at or under this is not over the ratio
        for value in reversed(ordered):
            others = median_of_others(value)
            if (value / others if others > 0 else 0.0) <= limit:
                bound = value
                break
        tracked = self._runs.keys() | self._held.since.keys()
        due: list[tuple[float, float]] = []  # (lost, held) of each rank whose run is due
        slow: list[Heartbeat] = []  # the ranks over the ratio, judged this poll
        ratios: dict[int, float] = {}
        looked = (works > bound) | np.isin(cols.rank, list(tracked))
        for i in np.flatnonzero(looked).tolist():
            beat, value = active[i], values[i]
            others = median_of_others(value)
            ratios[beat.rank] = self._judge(beat, value, others, now, exact(beat.rank),
                                            due, slow)
        spread.add(self._highest_under(ordered, median_of_others, active),
                   ordered[len(ordered) // 2])
        if not due:
            return None
        lost, held = max(due)
        # The job has had a straggler long enough. Blame the rank holding it back now, the
        # slowest: a mildly slow rank (its own background work) may have been over the ratio
        # longer, but a much slower one that turned up since sets every step's pace.
        beat = max(slow, key=lambda b: (work(b), -b.rank))
        others = median_of_others(work(beat))
        ratio = ratios[beat.rank]
        budget = "" if self.rule.lost_seconds is None else (
            f"lost_seconds {self.rule.lost_seconds:g}s, ")
        return Fault(FaultKind.STRAGGLER, beat.rank, beat.node,
                     {"summary": f"compute time {work(beat):.3f}s per step{_waited(beat)} is "
                      f"{ratio:.1f}x the other ranks' median {others:.3f}s; the job lost "
                      f"{lost:.1f}s waiting on a rank over {limit:.3g}x in {held:.1f}s "
                      f"({spread.describe()}, {budget}sustained {self.rule.sustained:g}s)",
                      "compute_seconds": {b.rank: round(b.compute_seconds or 0.0, 4)
                                          for b in active},
                      "cpu_wait_seconds": {b.rank: round(b.cpu_wait_seconds, 4) for b in active
                                           if b.cpu_wait_seconds is not None},
                      "ratio": round(ratio, 2), "lost_seconds": round(lost, 2)}, now)


def _waited(beat: Heartbeat) -> str:
    """Return ``" (and 0.040s waiting for a CPU)"`` where the rank said it waited."""
    waited = beat.cpu_wait_seconds
    return f" (and {waited:.3f}s waiting for a CPU)" if waited else ""


class ThroughputRule:
    """Fire when job samples/s stays below ``floor`` x its own baseline for ``sustained``."""

    def __init__(self, rule: ThroughputDetection) -> None:
        self.rule = rule
        self._slow = Sustained()
        self._samples: list[float] = []
        self._started: float | None = None
        self._first_step: int | None = None
        self.baseline: float | None = None
        self._spread = RateSpread(rule.floor)  # the floor in force (relay.watch.spread)
        self._dip: float | None = None  # the lowest rate of a dip going on
        self._work = UsualWork()  # the ranks' compute with a CPU, and their step time

    def check(self, active: list[Heartbeat], heard: int, now: float) -> Fault | None:
        """Return a fault once throughput has stayed low (``heard``: ranks with a record)."""
        rule = self.rule
        active = [b for b in active if b.samples_per_second]
        if not active or len(active) < heard:
            return None
        steps = min(b.step for b in active)
        if self._first_step is None:
            self._first_step = steps
        if steps < self._first_step + rule.warmup_steps:
            return None
        rate = min(b.samples_per_second or 0.0 for b in active)
        if self.baseline is None:
            self._started = self._started or now
            self._samples.append(rate)
            self._spread.add(rate, None)
            self._work.sample(active)
            if now - self._started >= rule.baseline:
                self.baseline = statistics.median(self._samples)
                self._spread.add(rate, self.baseline)
                self._work.settle()
            return None
        floor = self._spread.floor
        low = rate < floor * self.baseline
        # The ranks' own work slowed enough to put the job under the policy's floor (however
        # deep the CPU waits of a loaded host have lowered the floor in force): see UsualWork.
        slowed = rate < self.baseline and self._work.slowed(active, rule.floor)
        held = self._slow.hold("job", low or slowed, now)
        if not low:
            if self._dip is not None:  # a dip that recovered before sustained: the job's noise
                self._spread.add(self._dip, self.baseline)
                self._dip = None
            self._spread.add(rate, self.baseline)
        else:
            self._dip = rate if self._dip is None else min(self._dip, rate)
        if held < rule.sustained:
            return None
        adapted = "" if floor == rule.floor else (
            f", the policy's {rule.floor:.0%} lowered by the job's own dips")
        why = "" if low else f"; {self._work.describe()}"
        return Fault(FaultKind.THROUGHPUT_DEGRADED, None, None,
                     {"summary": f"job throughput {rate:.0f} samples/s is "
                      f"{rate / self.baseline:.0%} of its baseline {self.baseline:.0f} for "
                      f"{held:.1f}s (floor {floor:.0%}{adapted}, "
                      f"sustained {rule.sustained:g}s){why}",
                      "samples_per_second": round(rate, 1), "baseline": round(self.baseline, 1),
                      **self._work.evidence()},
                     now)
