"""`relay bench watcher`: CPU cost of the watcher with many simulated ranks.

A separate process plays N ranks on N/4 nodes: every second it rewrites each
rank's heartbeat (atomically, as real ranks do) and each node agent's status.
This process runs the real ``SegmentWatchTrigger`` over them, polling once a
second, and reports its own CPU time as a share of one core. The trigger must
also stay silent: healthy simulated ranks are not a fault.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relay.launchers.local import HANDLE_FILE, agent_handle
from relay.policy import Detection
from relay.triggers import SegmentWatchTrigger

_SIMULATOR = r"""
import json, random, sys, time
from pathlib import Path
from training.heartbeat import Heartbeat, heartbeat_path, write_atomically
root, ranks, per_node = Path(sys.argv[1]), int(sys.argv[2]), 4
(root / "heartbeats").mkdir(parents=True, exist_ok=True)
(root / "status").mkdir(parents=True, exist_ok=True)
step = 0
while True:
    now = time.time()
    step += 1
    for r in range(ranks):
        beat = Heartbeat(rank=r, node=f"node-{r // per_node}", pid=1, step=step,
                         phase="collective" if r % 2 else "compute", phase_started_at=now,
                         compute_seconds=0.1 * random.uniform(0.95, 1.05),
                         samples_per_second=1000.0 * random.uniform(0.98, 1.02), loss=2.0,
                         wall_clock=now, seq=step)
        write_atomically(heartbeat_path(root / "heartbeats", r), beat.to_json())
    for n in range(ranks // per_node):
        record = {"node": f"node-{n}", "state": "running", "wall_clock": now, "exit_codes": {}}
        write_atomically(root / "status" / f"node-{n}.json", json.dumps(record))
    time.sleep(max(0.0, 1.0 - (time.time() - now)))
"""


async def _watch(trigger: SegmentWatchTrigger, seconds: float) -> dict | None:
    async def first() -> dict:
        async for event in trigger.run():
            return dict(event.payload)
        return {}

    try:
        return await asyncio.wait_for(first(), seconds)
    except TimeoutError:
        return None


def main(ranks: int = 1024, seconds: float = 30.0) -> int:
    """Simulate ``ranks`` ranks for ``seconds`` and print the watcher's CPU share."""
    per_node = 4
    with tempfile.TemporaryDirectory(prefix="relay-bench-watcher-") as tmp:
        root = Path(tmp)
        sim = subprocess.Popen([sys.executable, "-c", _SIMULATOR, str(root), str(ranks)])
        try:
            nodes = {f"node-{n}": agent_handle(sim.pid) for n in range(ranks // per_node)}
            (root / HANDLE_FILE).write_text(json.dumps({"nodes": nodes, "started_at": time.time()}))
            node_ranks = {f"node-{n}": list(range(n * per_node, (n + 1) * per_node))
                          for n in range(ranks // per_node)}
            time.sleep(3.0)  # let the simulator write its first round
            trigger = SegmentWatchTrigger(
                attempt_dir=str(root), node_ranks=node_ranks,
                detection=Detection(poll_interval=1.0).model_dump(),
                heartbeat_interval_seconds=1.0, poll_interval_seconds=1.0,
            )
            cpu0, wall0 = time.process_time(), time.perf_counter()
            event = asyncio.run(_watch(trigger, seconds))
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        finally:
            sim.kill()
            sim.wait()
    print(f"Watcher cost: {ranks} simulated ranks on {ranks // per_node} nodes, heartbeats at "
          f"1 Hz, one poll per second for {wall:.0f}s")
    print(f"  watcher CPU: {cpu:.2f}s over {wall:.1f}s = {cpu / wall:.1%} of one core "
          "(goal <= 10%)")
    verdict = "none (correct: every simulated rank is healthy)" if event is None else event
    print(f"  events: {verdict}")
    return 0 if event is None else 1
