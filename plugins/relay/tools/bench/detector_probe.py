"""The detector's CPU a poll at many ranks, on modelled heartbeats (no I/O, no HTTP).

``relay bench watcher`` measures the whole watcher against live simulated agents, where a
loaded machine makes summaries late and the watcher fall back to asking every agent. This
probe isolates the detector: each poll's heartbeats come from the simulator's model of the
job (:class:`~relay.tools.bench.sim_cluster.Cluster`) on a simulated clock, every 0.5 s of
it, and only :meth:`Detector.check` and :meth:`Detector.due_at` are timed
(``time.process_time``), after a warm-up past the straggler rule's start-up.

Run: ``python -m relay.tools.bench.detector_probe [NODES [RANKS_PER_NODE [POLLS]]]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from relay.tools.bench.sim_cluster import Cluster
from relay.tools.bench.watcher import default_detection
from relay.watch.detection import Detector
from relay.watch.observation import Observation

WARMUP_POLLS = 10
T0 = 1_000_000.0


def probe(nodes: int, per_node: int, polls: int) -> tuple[float, int]:
    """Return the median CPU seconds of one check at ``nodes`` x ``per_node``, and the
    faults called (a healthy job: none)."""
    job = Cluster(nodes, per_node, T0)
    node_ranks = {job.node_name(n): job.ranks_of(job.node_name(n)) for n in range(nodes)}
    detector = Detector(default_detection())
    took: list[float] = []
    faults = 0
    for i in range(WARMUP_POLLS + polls):
        now = T0 + 20.0 + 0.5 * i
        beats = {r: b for r in range(nodes * per_node) if (b := job.heartbeat(r, now))}
        obs = Observation(now=now, launched_at=T0, heartbeats=beats, node_ranks=node_ranks,
                          heartbeat_interval=0.5)
        began = time.process_time()
        faults += detector.check(obs) is not None
        detector.due_at(obs)
        if i >= WARMUP_POLLS:
            took.append(time.process_time() - began)
    return statistics.median(took), faults


def main(argv: list[str]) -> int:
    """Print the detector's median CPU a poll."""
    nodes, per_node, polls = ([int(a) for a in argv] + [1024, 8, 50][len(argv):])[:3]
    seconds, faults = probe(nodes, per_node, polls)
    print(f"detector at {nodes} nodes x {per_node} ranks: {seconds * 1000:.0f} ms CPU a poll "
          f"(median of {polls}), {faults} fault(s) called (healthy: 0); load average "
          f"{os.getloadavg()[0]:.1f}")
    return int(faults > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
