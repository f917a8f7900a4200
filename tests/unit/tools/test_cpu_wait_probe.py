"""relay.tools.bench.cpu_wait_probe reads the ranks' records once every rank has stepped."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.tools.bench.cpu_wait_probe import _figures, _ratio, sample
from relay_train.protocol.heartbeat import Heartbeat, heartbeat_path


def test_it_samples_once_every_rank_says_its_compute_and_its_wait(tmp_path: Path) -> None:
    for rank in range(4):
        beat = Heartbeat(rank=rank, node="n", pid=1, step=5, compute_seconds=0.05,
                         cpu_wait_seconds=0.01 * (rank + 1))
        heartbeat_path(tmp_path, rank).write_text(beat.to_json())
    polls = sample(tmp_path, 1.0)
    assert polls and all(sorted(p) == [0, 1, 2, 3] for p in polls)
    assert polls[0][0].cpu_wait_seconds == 0.01


def test_figures_give_min_median_max_and_the_spread() -> None:
    assert _figures([0.010, 0.020, 0.040]) == " 10.0 /  20.0 /  40.0 ms (max/min 4.0x)"


def test_a_ranks_ratio_is_its_work_over_the_other_ranks_median() -> None:
    beats = {rank: Heartbeat(rank=rank, node="n", pid=1, step=5, compute_seconds=c,
                             cpu_wait_seconds=w)
             for rank, (c, w) in enumerate([(0.030, 0.010), (0.020, 0.010), (0.050, 0.040),
                                            (0.012, 0.0)])}
    assert _ratio(beats, 0) == pytest.approx(2.0)  # the others' work: 0.010, 0.010, 0.012
    assert _ratio(beats, 3) == pytest.approx(1.2)
