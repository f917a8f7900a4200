"""The detector probe times a healthy modelled job's checks and calls nothing on it."""

from __future__ import annotations

from relay.tools.bench.detector_probe import probe


def test_the_probe_times_checks_of_a_healthy_job_and_calls_no_fault() -> None:
    seconds, faults = probe(nodes=16, per_node=2, polls=3)
    assert faults == 0
    assert seconds > 0
