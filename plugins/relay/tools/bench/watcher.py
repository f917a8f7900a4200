"""`relay bench watcher`: CPU cost of the watcher with many simulated ranks.

A separate process plays N ranks on N/4 nodes: every heartbeat interval (the
job spec's default, 0.5 s) it rewrites each rank's heartbeat in its node's
folder (atomically, as real ranks do), and serves each node's real agent
channel (:class:`relay_train.agent.server.AgentServer`) on loopback. This process
runs the real ``SegmentWatchTrigger`` over them, asking every agent over HTTP,
at the policy's default poll interval (``Detection().poll_interval``, 0.5 s),
and reports its own CPU time as a share of one core, for 1,024 and 4,096 ranks
by default. The trigger must also stay silent: healthy simulated ranks are not
a fault, unless the simulator itself falls behind (its achieved interval is
printed, so such an event can be told apart from a watcher bug).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relay.launchers.local.launcher import HANDLE_FILE, agent_handle
from relay.policy.model import Detection
from relay.watch.triggers import SegmentWatchTrigger
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig

_SIMULATOR = r"""
import json, random, sys, time
from pathlib import Path
from relay_train.agent.server import AgentServer
from relay_train.protocol.heartbeat import Heartbeat, heartbeat_path, write_atomically
from relay_train.protocol.routes import EXIT_CODES, STATE, NodeState
root, ranks, per_node = Path(sys.argv[1]), int(sys.argv[2]), 4
interval, attempt_id, rounds = float(sys.argv[3]), sys.argv[4], 0
secret = sys.stdin.readline().strip()  # the channel secret: not on the command line

class Node:  # what the real agent serves: its state; heartbeats from its node-local folder
    def __init__(self, n):
        self.node, self.attempt_id = f"node-{n}", attempt_id
        self.root = root / "nodes" / self.node
        self.ranks = list(range(n * per_node, (n + 1) * per_node))
        (self.root / "heartbeats").mkdir(parents=True, exist_ok=True)
    def status_record(self):
        return {STATE: NodeState.RUNNING, EXIT_CODES: {str(r): None for r in self.ranks}}
    def request_stop(self, reason):
        pass

nodes = [Node(n) for n in range(ranks // per_node)]
started = time.time()
step = 0
while True:
    now = time.time()
    step += 1
    for node in nodes:
        for r in node.ranks:
            beat = Heartbeat(rank=r, node=node.node, pid=1, step=step,
                             phase="collective" if r % 2 else "compute", phase_started_at=now,
                             compute_seconds=0.1 * random.uniform(0.95, 1.05),
                             samples_per_second=1000.0 * random.uniform(0.98, 1.02), loss=2.0,
                             wall_clock=now, seq=step)
            write_atomically(heartbeat_path(node.root / "heartbeats", r), beat.to_json())
    if step == 1:  # every node's agent channel, once its first heartbeats exist
        servers = {n.node: AgentServer(n, "127.0.0.1", 0, secret=secret).start().address[1]
                   for n in nodes}
        write_atomically(root / "ports.json", json.dumps(servers))
    rounds += 1
    (root / "simulator.json").write_text(json.dumps({"interval": (time.time() - started) / rounds}))
    time.sleep(max(0.0, interval - (time.time() - now)))
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


def _launch_file(root: Path, nodes: int, per_node: int) -> str:
    """Write the simulated attempt's launch file (where the watcher's channel finds the
    secret); return its channel secret."""
    secret = new_secret()
    LaunchConfig(job="bench", seed=0, model={}, data={}, optimizer={}, start_step=0,
                 end_step=0, checkpoint_every=0, nodes=[f"node-{n}" for n in range(nodes)],
                 ranks_per_node=per_node, tracking_uri="", run_id="", attempt_dir=str(root),
                 attempt=1, segment=0, channel_secret=secret).write(root / LAUNCH_FILE)
    return secret


def measure(ranks: int, seconds: float, heartbeat_interval: float) -> int:
    """Simulate ``ranks`` ranks for ``seconds``; print the watcher's CPU share; 0 if silent."""
    per_node = 4
    poll = Detection().poll_interval
    with tempfile.TemporaryDirectory(prefix="relay-bench-watcher-") as tmp:
        root = Path(tmp)
        attempt_id = "bench/watcher/segment-000/try-1"
        secret = _launch_file(root, ranks // per_node, per_node)
        sim = subprocess.Popen([sys.executable, "-c", _SIMULATOR, str(root), str(ranks),
                                str(heartbeat_interval), attempt_id], stdin=subprocess.PIPE)
        assert sim.stdin is not None
        sim.stdin.write(f"{secret}\n".encode())
        sim.stdin.close()
        try:
            while not (root / "simulator.json").exists():  # its first round is written
                time.sleep(0.2)
            ports = json.loads((root / "ports.json").read_text())
            nodes = {node: {**agent_handle(sim.pid), "port": port}
                     for node, port in ports.items()}
            (root / HANDLE_FILE).write_text(json.dumps({
                "nodes": nodes, "started_at": time.time(), "attempt_id": attempt_id}))
            node_ranks = {f"node-{n}": list(range(n * per_node, (n + 1) * per_node))
                          for n in range(ranks // per_node)}
            # A poll reads every file whatever its age, so the cost does not depend on how
            # fast the simulator keeps up; but a simulator slower than the heartbeat timeout
            # would look like dead ranks: then the timeout (only) is raised, and said so.
            # Generously: one process answering 1,024 agents' requests on 2 cores also
            # answers late, and a late answer carries an older heartbeat.
            first = json.loads((root / "simulator.json").read_text())["interval"]
            detection = Detection()
            if 2 * first > detection.heartbeat_timeout:
                detection = Detection(heartbeat_timeout=10 * first)
                print(f"  {ranks:>6} ranks: heartbeat_timeout raised to {10 * first:.1f}s: the "
                      f"simulator needs {first:.1f}s to rewrite every file here", flush=True)
            trigger = SegmentWatchTrigger(
                attempt_dir=str(root), node_ranks=node_ranks,
                detection=detection.model_dump(),
                heartbeat_interval_seconds=heartbeat_interval, poll_interval_seconds=poll,
            )
            cpu0, wall0 = time.process_time(), time.perf_counter()
            event = asyncio.run(_watch(trigger, seconds))
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            achieved = json.loads((root / "simulator.json").read_text())["interval"]
        finally:
            sim.kill()
            sim.wait()
    polls = max(wall / poll, 1.0)
    print(f"  {ranks:>6} ranks on {ranks // per_node:>5} nodes: watcher CPU {cpu:6.2f}s over "
          f"{wall:5.1f}s = {cpu / wall:6.1%} of one core, ~{cpu / polls * 1000:.0f} ms per poll; "
          f"simulator rewrote every heartbeat every {achieved:.2f}s "
          f"(asked {heartbeat_interval:g}s)")
    verdict = "none (correct: every simulated rank is healthy)" if event is None else event
    print(f"  {'':6} events: {verdict}")
    return 0 if event is None else 1


def main(ranks: list[int] | None = None, seconds: float = 30.0, heartbeat_interval: float = 0.5,
         smoke: bool = False) -> int:
    """Measure the watcher at each rank count."""
    counts = ranks or [1024, 4096]
    if smoke:
        counts, seconds = [64, 256], 5.0
    print(f"Watcher cost{' (SMOKE: too small for figures)' if smoke else ''}: the real "
          f"SegmentWatchTrigger polling every {Detection().poll_interval:g}s (the policy "
          f"default) over simulated nodes' agents (HTTP on loopback), {seconds:g}s per size. "
          "Compared "
          "with: one core (the share of it the triggerer spends on one job)")
    return max(measure(n, seconds, heartbeat_interval) for n in counts)
