"""relay.watch.columns: one poll's records as arrays, and per-rank figures kept by rank."""

from __future__ import annotations

import numpy as np

from relay.watch.columns import MAX_RANKS, UNKNOWN_PHASE, RankArrays, RankColumns, code_of
from relay_train.protocol.heartbeat import Heartbeat, Phase


def beat(rank: int, step: int, phase: str = Phase.COMPUTE.value,
         cpu_wait_total: float | None = None) -> Heartbeat:
    return Heartbeat(rank=rank, node="n", pid=1, step=step, phase=phase,
                     wall_clock=100.0 + rank, cpu_wait_total=cpu_wait_total)


def test_columns_hold_each_records_fields_in_the_records_order() -> None:
    records = [beat(3, 7, Phase.COLLECTIVE.value, 0.5), beat(1, 8, "a newer phase"), beat(0, 9)]
    cols = RankColumns.of(records)
    assert cols.rank.tolist() == [3, 1, 0] and cols.step.tolist() == [7, 8, 9]
    assert cols.phase.tolist() == [code_of("collective"), UNKNOWN_PHASE, code_of("compute")]
    assert cols.wall_clock.tolist() == [103.0, 101.0, 100.0]
    assert cols.cpu_wait_total.tolist() == [0.5, 0.0, 0.0]  # unsaid: none
    assert cols.in_phase(Phase.COMPUTE.value, Phase.COLLECTIVE.value).tolist() == [
        True, False, True]
    assert cols.rows(cols.step > 7) == records[1:]
    assert len(RankColumns.of([])) == 0


def test_a_record_whose_rank_no_array_can_hold_is_left_out() -> None:
    """Per-rank arrays are indexed by rank: a record of rank 2**40 (no job's) must not
    make a rule allocate terabytes, nor a negative one index from the end."""
    cols = RankColumns.of([beat(-1, 1), beat(2, 2), beat(MAX_RANKS, 3), beat(MAX_RANKS - 1, 4)])
    assert cols.rank.tolist() == [2, MAX_RANKS - 1] and cols.step.tolist() == [2, 4]
    assert [b.rank for b in cols.beats] == [2, MAX_RANKS - 1]


def test_rank_arrays_grow_to_the_highest_rank_and_keep_what_they_held() -> None:
    arrays = RankArrays(step=(np.int64, 0), at=(np.float64, -1.0))
    arrays.fit(np.array([2]))
    arrays["step"][2], arrays.seen[2] = 5, True
    arrays.fit(np.array([1, 40]))
    assert len(arrays.seen) >= 41 and arrays["step"][2] == 5 and arrays.seen[2]
    assert arrays["at"][40] == -1.0 and not arrays.seen[40]
    arrays.fit(np.array([], np.int64))  # nothing heard: nothing changes
    assert arrays["step"][2] == 5
