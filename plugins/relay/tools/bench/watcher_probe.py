"""The watcher's CPU a poll through aggregators, at many ranks, with no HTTP.

``relay bench watcher`` measures the whole watcher against live simulated agents; on a
loaded machine its summaries come late and the watcher falls back to asking every agent,
so its figure is not the aggregated path's. This probe times that path alone, per poll:
the JSON of :data:`~relay.launchers.agent_groups.GROUP_SIZE`-node summaries (built by the
real :func:`~relay.launchers.agent_groups.encode_summary` from the simulator's model of the
job, :class:`~relay.tools.bench.sim_cluster.Cluster`, outside the timing) parsed as the
channel parses them (:func:`~relay.launchers.agent_requests.parse_answer`), merged
by the real :class:`~relay.launchers.agent_client.AgentChannel`, a launch status built as
the launchers do, then :meth:`Detector.check` and :meth:`Detector.due_at`, on a simulated
clock every 0.5 s, after a warm-up past the straggler rule's start-up. The triggerer's
modules (Airflow) are imported first, so the garbage collector walks a heap of its size.
What is left out: the HTTP exchange and its HMAC (~1-2 ms a summary), the PID checks.

Run: ``python -m relay.tools.bench.watcher_probe [NODES [POLLS]] [--profile]``; it prints
the median, mean and max of ``time.process_time`` a poll, and the load average.
"""

from __future__ import annotations

import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import time

import relay.watch.triggers  # noqa: F401 - the triggerer's heap (Airflow, Relay)
from relay.core.attempt import AttemptState
from relay.launchers.agent_client import AgentChannel
from relay.launchers.agent_groups import Group, encode_summary, fresh, groups_of
from relay.launchers.agent_requests import parse_answer
from relay.launchers.base import LaunchStatus, NodeStatus
from relay.tools.bench.sim_cluster import Cluster
from relay.tools.bench.watcher import default_detection
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay_train.protocol.routes import HEARTBEATS, STATE, NodeState

PER_NODE = 8
WARMUP_POLLS = 10
T0 = 1_000_000.0


class Probe:
    """One watcher's side of a simulated job read through its aggregators."""

    def __init__(self, nodes: int) -> None:
        self.job = Cluster(nodes, PER_NODE, T0)
        names = [self.job.node_name(n) for n in range(nodes)]
        self.node_ranks = {n: self.job.ranks_of(n) for n in names}
        self.groups = [Group(f"agg-{i}", "http://127.0.0.1:9", tuple(g))
                       for i, g in enumerate(groups_of(names))]
        self.channel = AgentChannel("probe", {n: "http://127.0.0.1:9" for n in names},
                                    "secret", groups=self.groups)
        self.detector = Detector(default_detection())

    def wires(self, now: float) -> list[bytes]:
        """Return each aggregator's summary at ``now`` as it comes over the wire."""
        job = self.job
        return [json.dumps(encode_summary(
            {n: (now - 0.05, {STATE: NodeState.RUNNING.value, HEARTBEATS: job.report(n, now)})
             for n in group.nodes}, now)).encode() for group in self.groups]

    def poll(self, wires: list[bytes], now: float) -> bool:
        """Do one poll's work on ``wires`` received at ``now``; return whether a fault came."""
        channel = self.channel
        for group, wire in zip(self.groups, wires, strict=True):
            summary = parse_answer(wire)  # as the channel parses it (msgspec)
            if fresh(summary):
                channel._merge(group, now, summary)  # noqa: SLF001 - the poll's own step
        nodes = {}
        for node, report in channel.reports.items():  # as the launchers build it
            nodes[node] = NodeStatus(node, NodeState(report.record.get(STATE)), {}, "",
                                     report.received_at, round_trip=report.round_trip)
        status = LaunchStatus(AttemptState.RUNNING, nodes, dict(channel.beats),
                              list(channel.refused), set(channel.crossed))
        obs = Observation(now=now, launched_at=T0, heartbeats=status.heartbeats,
                          node_ranks=self.node_ranks, heartbeat_interval=0.5, launch=status)
        fault = self.detector.check(obs)
        self.detector.due_at(obs)
        return fault is not None


def run(nodes: int, polls: int, profile: cProfile.Profile | None = None
        ) -> tuple[list[float], int]:
    """Return the CPU seconds of each timed poll, and the faults called (healthy: 0)."""
    probe = Probe(nodes)
    took: list[float] = []
    faults = 0
    for i in range(WARMUP_POLLS + polls):
        now = T0 + 20.0 + 0.5 * i
        wires = probe.wires(now)
        timed = i >= WARMUP_POLLS
        if timed and profile is not None:
            profile.enable()
        began = time.process_time()
        faults += probe.poll(wires, now)
        if timed:
            took.append(time.process_time() - began)
            if profile is not None:
                profile.disable()
    return took, faults


def main(argv: list[str]) -> int:
    """Print the watcher's CPU a poll (and, with ``--profile``, where it goes)."""
    profile = cProfile.Profile() if "--profile" in argv else None
    args = [int(a) for a in argv if not a.startswith("--")]
    nodes, polls = (args + [1024, 40][len(args):])[:2]
    took, faults = run(nodes, polls, profile)
    ms = [t * 1000 for t in took]
    print(f"watcher at {nodes} nodes x {PER_NODE} ranks: {statistics.median(ms):.0f} ms CPU a "
          f"poll median, mean {statistics.mean(ms):.0f}, max {max(ms):.0f} ({polls} polls), "
          f"{faults} fault(s) called (healthy: 0); gc {'on' if gc.isenabled() else 'off'}; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return int(faults > 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
