"""The watcher probe times a healthy modelled job read through aggregators, and calls no
fault on it."""

from __future__ import annotations

from relay.tools.bench.watcher_probe import run


def test_the_probe_reads_a_healthy_job_through_its_aggregators_and_calls_no_fault() -> None:
    took, faults = run(nodes=64, polls=3)
    assert faults == 0
    assert len(took) == 3 and all(t > 0 for t in took)
