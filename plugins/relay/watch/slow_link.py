"""A slow or lossy link: which node's network, when the whole job slows down.

A slow link slows every rank alike: each waits for the collective that crosses it,
and no rank's compute time changes, so the straggler rule (compute per rank) sees
nothing and the throughput rule sees a job-wide fault with no culprit. What does
tell the nodes apart is the watcher's own channel: its status request to each
node's agent crosses that node's link alone, and a link that is rate-limited or
losing packets (its queue full of the collective's traffic, or retransmits) makes
that node's answer late, every poll.

:class:`LinkWatch` keeps each node's last round trips (asked to answered,
:attr:`relay.launchers.base.NodeStatus.round_trip`) and, when the throughput rule
fires, names the node whose median round trip stands out from the others' by
:data:`RATIO` and by :data:`MIN_EXTRA_SECONDS`. The fault becomes a straggler of
that node (its link holds every step back, as a slow rank would): the policy's
straggler rule then moves off it and quarantines it. With no node standing out
(the job itself slowed: its data, its host's load) the throughput fault stands.

Measured on the Slurm test bed (3 namespace hosts, load 10-15): healthy medians of
5-20 ms on every node (single answers up to 0.23 s under load); ``tbf rate 1mbit``
on node3's link: 16.6 -> 1.2 steps/s, node3's median 0.21 s, the others' 5 ms.
"""

from __future__ import annotations

import statistics
from collections import deque

from relay.core.faults import Fault, FaultKind
from relay.watch.observation import Observation

WINDOW = 8  # each node's last round trips judged (a poll each: ~4 s at 0.5 s polls)
MIN_SAMPLES = 4  # fewer round trips than this: no judgement on that node
RATIO = 5.0  # a node's median round trip over RATIO x the others' median
MIN_EXTRA_SECONDS = 0.1  # and this much longer: a few ms more under load is nothing


class LinkWatch:
    """Each node's recent channel round trips, and the node whose link stands out."""

    def __init__(self) -> None:
        self._trips: dict[str, deque[float]] = {}
        self._answered: dict[str, float | None] = {}  # node -> the answer last counted

    def observe(self, obs: Observation) -> None:
        """Count each node's newest answer once (a poll may reuse the last one)."""
        if obs.launch is None:
            return
        for node, status in obs.launch.nodes.items():
            if status.round_trip is None or self._answered.get(node) == status.last_seen:
                continue
            self._answered[node] = status.last_seen
            self._trips.setdefault(node, deque(maxlen=WINDOW)).append(status.round_trip)

    def slow_node(self) -> tuple[str, float, float] | None:
        """Return (node, its median round trip, the others' median) for the one node whose
        link stands out, or None."""
        medians = {n: statistics.median(t) for n, t in self._trips.items()
                   if len(t) >= MIN_SAMPLES}
        if len(medians) < 2:
            return None
        node = max(medians, key=lambda n: (medians[n], n))
        others = statistics.median(m for n, m in medians.items() if n != node)
        mine = medians[node]
        if mine - others < MIN_EXTRA_SECONDS or mine < RATIO * others:
            return None
        return node, mine, others

    def attribute(self, fault: Fault) -> Fault:
        """Return ``fault`` (a job-wide throughput fault) as a straggler of the node whose
        link stands out; ``fault`` itself when none does."""
        found = self.slow_node()
        if fault.kind is not FaultKind.THROUGHPUT_DEGRADED or found is None:
            return fault
        node, mine, others = found
        trips = {n: round(statistics.median(t), 3) for n, t in sorted(self._trips.items())}
        return Fault(
            FaultKind.STRAGGLER, None, node,
            {"summary": f"{node}'s link is slow: {fault.evidence.get('summary', 'throughput')}"
             f"; the watcher's status round trip to {node}'s agent is {mine:.3f}s (median of "
             f"its last {len(self._trips[node])}), {mine / max(others, 1e-3):.0f}x the other "
             f"nodes' {others:.3f}s (over {RATIO:g}x and {MIN_EXTRA_SECONDS:g}s more)",
             "link_round_trip_seconds": trips, "throughput": fault.evidence},
            fault.detected_at)
