"""Where the real watcher's CPU goes: cProfile of one trigger over the simulated agents.

``relay bench watcher`` prints what a poll costs; this says where. It starts the same
simulator (through its aggregators, one per 32 nodes), runs the real
:class:`~relay.watch.triggers.SegmentWatchTrigger` for ``SECONDS`` of a fault-free job
under cProfile, and prints the CPU a poll (``time.process_time``, every thread) and the
event loop thread's profile, by own time and by cumulative time. The summaries are read in
a worker thread, which cProfile does not see: the CPU a poll minus the loop thread's share
is theirs.

Run: ``python -m relay.tools.bench.watcher_profile [NODES [SECONDS]]`` (default 1024 20).
"""

from __future__ import annotations

import asyncio
import cProfile
import os
import pstats
import sys
import time

from relay.launchers.agent_groups import GROUP_SIZE
from relay.tools.bench.watcher import (
    PollTimer,
    _first_event,
    _trigger,
    default_detection,
    simulated,
)

PER_NODE = 8
SETTLE_SECONDS = 3.0  # the simulator's aggregators have made their first rounds


def main(nodes: int = 1024, seconds: float = 20.0) -> int:
    """Profile the watcher at ``nodes`` x 8 ranks for ``seconds``; print the figures."""
    detection = default_detection()
    print(f"cProfile of the watcher at {nodes} nodes x {PER_NODE} ranks for {seconds:g}s "
          f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    with simulated(nodes, PER_NODE, GROUP_SIZE) as (root, _sims), PollTimer() as polls:
        time.sleep(SETTLE_SECONDS)
        profile = cProfile.Profile()
        began = time.process_time()
        profile.enable()
        asyncio.run(_first_event(_trigger(root, nodes, PER_NODE, detection), seconds))
        profile.disable()
        cpu = time.process_time() - began
    count = max(len(polls.seconds), 1)
    print(f"{len(polls.seconds)} polls, CPU {cpu:.2f}s in all threads = "
          f"{1000 * cpu / count:.0f} ms a poll (under the profiler)")
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(int(args[0]) if args else 1024, float(args[1]) if len(args) > 1 else 20.0))
