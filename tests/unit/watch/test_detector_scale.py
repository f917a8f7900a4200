"""The detector's per-rank shortcuts answer exactly what the plain computations do."""

from __future__ import annotations

import random
import statistics

from relay.watch.observation import Observation
from relay.watch.slowness import leave_one_out


def test_leave_one_out_is_the_median_of_the_others_for_every_value() -> None:
    rng = random.Random(7)
    for size in range(2, 40):
        # few distinct values: ties around the middle are the hard case
        values = sorted(rng.choice([0.1, 0.2, 0.2, 0.3, rng.random()]) for _ in range(size))
        median = leave_one_out(values)
        for i, value in enumerate(values):
            others = values[:i] + values[i + 1:]
            assert median(value) == statistics.median(others), (values, value)


def test_node_of_answers_the_first_node_listing_a_rank() -> None:
    node_ranks = {"a": [0, 1], "b": [2, 1], "c": []}
    obs = Observation(now=0.0, launched_at=0.0, heartbeats={}, node_ranks=node_ranks,
                      heartbeat_interval=0.2)
    assert [obs.node_of(r) for r in (0, 1, 2, 3)] == ["a", "a", "b", None]
