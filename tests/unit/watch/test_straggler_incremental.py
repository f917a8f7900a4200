"""The straggler rule looks one by one only at the ranks over the ratio (and those with a
clock or a run to end): it must judge exactly as a pass over every rank does.

:class:`FullPass` is the rule as it was before (every rank's ratio, excess and clock each
poll), kept here as the reference; both are fed the same random sequences of polls
(jitter, slow ranks coming and going, ranks not stepping, a machine-wide slowdown) and
must agree on every fault, every clock, every run and the spread's ratio.
"""

from __future__ import annotations

import random

import pytest

from relay.core.faults import Fault
from relay.policy.model import StragglerDetection
from relay.watch.columns import RankColumns
from relay.watch.slowness import StragglerRule, leave_one_out
from relay.watch.spread import work
from relay_train.protocol.heartbeat import Heartbeat, Phase


class FullPass(StragglerRule):
    """The rule judging every rank every poll, one Python record a rank (the reference)."""

    def __init__(self, rule: StragglerDetection) -> None:
        super().__init__(rule)
        self._ref_totals: dict[int, tuple[int, float, float]] = {}

    def totals(self) -> dict[int, tuple[int, float, float]]:
        return dict(self._ref_totals)

    def _interval_excess(self, cols: RankColumns, now: float):  # type: ignore[no-untyped-def, override]
        per_step: dict[int, tuple[float, int, float]] = {}
        for beat in cols.beats:
            if beat.compute_total is None:
                continue
            total = beat.compute_total - (beat.cpu_wait_total or 0.0)  # the work's alone
            seen = self._ref_totals.get(beat.rank)
            if seen is not None and beat.step > seen[0] and total >= seen[1]:
                steps = beat.step - seen[0]
                per_step[beat.rank] = ((total - seen[1]) / steps, steps, seen[2])
            if seen is None or beat.step != seen[0]:
                self._ref_totals[beat.rank] = (beat.step, total, now)
        if len(per_step) < 2:
            return lambda _rank: None
        others = leave_one_out(sorted(p for p, _, _ in per_step.values()))
        exact = {rank: min(max(p - others(p), 0.0) * steps, now - since)
                 for rank, (p, steps, since) in per_step.items()}
        return exact.get

    def check(self, stepping: RankColumns, now: float) -> Fault | None:
        active = [b for b in stepping.beats if b.compute_seconds]
        judged = {b.rank for b in active} if len(active) >= 2 else set()
        for rank in [r for r in self._held.since if r not in judged]:
            self._held.pause(rank)
        if not judged:
            return None
        exact = self._interval_excess(RankColumns.of(active), now)
        if self._stepping_since is None:
            self._stepping_since = now
        if now - self._stepping_since < self.rule.sustained:
            return None
        ordered = sorted(work(b) for b in active)
        median_of_others = leave_one_out(ordered)
        limit = self._spread.ratio
        ratios: dict[int, float] = {}
        due: list[tuple[float, float]] = []
        slow: list[Heartbeat] = []
        for beat in active:
            others = median_of_others(work(beat))
            ratios[beat.rank] = self._judge(beat, work(beat), others, now, exact(beat.rank),
                                            due, slow)
        suspects = self._runs.keys() | self._spread.suspects
        under = [ratios[b.rank] for b in active
                 if ratios[b.rank] <= limit and b.rank not in suspects]
        self._spread.add(max(under) if under else None, ordered[len(ordered) // 2])
        if not due:
            return None
        return Fault.__new__(Fault)  # the fault's text is the shared code's (below)


def _polls(seed: int, ranks: int, polls: int) -> list[tuple[float, list[Heartbeat]]]:
    """Return a random job: per poll, the time and the stepping ranks' records."""
    rng = random.Random(seed)
    step = dict.fromkeys(range(ranks), 0)
    total = dict.fromkeys(range(ranks), 0.0)
    waited = dict.fromkeys(range(ranks), 0.0)
    slow: dict[int, float] = {}
    base, out = 0.05, []
    for i in range(polls):
        now = 1_000.0 + 0.5 * i
        if rng.random() < 0.15:  # a rank turns slow, or recovers
            rank = rng.randrange(ranks)
            if rank in slow:
                del slow[rank]
            else:
                slow[rank] = rng.choice([1.3, 1.6, 2.0, 3.0, 8.0])
        if rng.random() < 0.05:
            base *= rng.choice([0.5, 2.0, 3.0])  # the whole machine slows, or recovers
        beats = []
        for rank in range(ranks):
            if rng.random() < 0.05:
                continue  # not stepping this poll (a late answer)
            steps = rng.choice([0, 1, 3, 5])
            per = base * slow.get(rank, 1.0) * rng.uniform(0.9, 1.1)
            wait = per * rng.uniform(0.0, 3.0)  # waiting for a CPU, on top of its work
            step[rank] += steps
            total[rank] += (per + wait) * steps
            waited[rank] += wait * steps
            says = rng.random() > 0.1  # most ranks say their CPU wait
            beats.append(Heartbeat(rank=rank, node=f"node-{rank // 4}", pid=1, step=step[rank],
                                   phase=Phase.COMPUTE.value, phase_started_at=now,
                                   compute_seconds=per + wait if rng.random() > 0.02 else 0.0,
                                   compute_total=None if rng.random() < 0.03 else total[rank],
                                   cpu_wait_seconds=wait if says else None,
                                   cpu_wait_total=waited[rank] if says else None,
                                   wall_clock=now))
        out.append((now, beats))
    return out


def _state(rule: StragglerRule) -> tuple[object, ...]:
    runs = {r: vars(run) for r, run in rule._runs.items()}
    return (runs, dict(rule._held.since), set(rule._held.paused), rule.totals(),
            rule.ratio, dict(rule._spread._ended))


@pytest.mark.parametrize("seed", range(8))
def test_judging_only_the_ranks_over_the_ratio_equals_a_pass_over_every_rank(seed: int) -> None:
    policy = StragglerDetection(sustained=3.0, lost_seconds=1.0)
    fast, full = StragglerRule(policy), FullPass(policy)
    slow_seen = False
    for now, beats in _polls(seed, ranks=4 + seed * 4, polls=80):
        got = fast.check(RankColumns.of(beats), now)
        want = full.check(RankColumns.of(beats), now)
        assert (got is None) == (want is None), f"poll at {now}"
        assert _state(fast) == _state(full), f"poll at {now}"
        slow_seen = slow_seen or bool(fast._runs)
    assert slow_seen  # the sequence had slow ranks to judge
