"""`relay bench watcher`: what the watcher costs, and how fast it detects, at many nodes.

Other processes (:mod:`relay.tools.bench.agent_sim`, one per group of nodes) serve every
simulated node's agent channel on loopback: the real server's request handling and HMAC
credential, 8 ranks a node by default, their heartbeats modelled on the clock. This
process runs the real ``SegmentWatchTrigger`` over them (asking every agent over HTTP, as
on a cluster) with the thresholds of ``policies/default.yaml`` at its poll interval, so the
CPU figure is the watcher's own. Per size it reports:

- a fault-free run of ``--seconds``: the watcher's CPU as a share of one core, its
  resident memory, and each poll's latency (one ``observe_attempt``: every agent asked)
  p50/p99; it must stay silent;
- one run per scripted fault (a frozen node, a hang, a straggler), struck after a warm-up:
  the detection latency (the event's ``detected_at`` - the strike), and whether the
  watcher named the right kind and culprit;
- above ``DIRECT_MAX_NODES`` nodes (unless ``direct``), the watcher reads them through the
  simulator's aggregators (:mod:`relay.launchers.agent_groups`, ``GROUP_SIZE`` nodes each),
  and one more run freezes an aggregator: the watcher must stay silent (its nodes are
  asked directly).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import relay
from relay.launchers.agent_groups import DIRECT_MAX_NODES, GROUP_SIZE
from relay.launchers.local.launcher import HANDLE_FILE, agent_handle
from relay.policy.model import Detection, load_policy
from relay.tools.bench.agent_sim import ports_file, shards_for
from relay.tools.bench.sim_cluster import SimFault
from relay.watch import triggers
from relay.watch.triggers import SegmentWatchTrigger
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig

ATTEMPT_ID = "bench/watcher/segment-000/try-1"
WARMUP_SECONDS = 5.0  # before a fault strikes: past the straggler rule's start-up
DETECT_WITHIN_SECONDS = 20.0
QUIET_SECONDS = 10.0  # watched after an aggregator froze: no event may come
DEFAULT_POLICY = Path(relay.__file__).resolve().parents[2] / "policies" / "default.yaml"


@dataclass(frozen=True)
class Trial:
    """One scripted fault and what the watcher must call it."""

    name: str
    kind: str  # the simulator's
    expected: str  # the watcher's fault kind
    on_node: bool


TRIALS = (
    Trial("frozen node", "stop_node", "node_unresponsive", True),
    Trial("hang", "hang", "hang", False),
    Trial("straggler", "straggler", "straggler", False),
)


def default_detection() -> Detection:
    """Return the thresholds of ``policies/default.yaml`` (the model's defaults without it)."""
    if DEFAULT_POLICY.exists():
        return load_policy(DEFAULT_POLICY).policy.detection
    return Detection()


@contextmanager
def simulated(nodes: int, per_node: int, group_size: int = 0,
              ) -> Iterator[tuple[Path, list[subprocess.Popen[bytes]]]]:
    """Start the simulator for ``nodes`` nodes (and their aggregators, ``group_size`` nodes
    each: 0 for none), one process per group (:func:`shards_for`); yield the attempt folder
    and the processes."""
    with tempfile.TemporaryDirectory(prefix="relay-bench-watcher-") as tmp:
        root = Path(tmp)
        secret = new_secret()
        names = [f"node-{n}" for n in range(nodes)]
        LaunchConfig(job="bench", seed=0, model={}, data={}, optimizer={}, start_step=0,
                     end_step=0, checkpoint_every=0, nodes=names, ranks_per_node=per_node,
                     tracking_uri="", run_id="", attempt_dir=str(root), attempt=1, segment=0,
                     channel_secret=secret).write(root / LAUNCH_FILE)
        shards, started_at = shards_for(nodes, group_size), time.time()
        sims: list[subprocess.Popen[bytes]] = []
        try:
            for shard in range(shards):
                sims.append(subprocess.Popen(
                    [sys.executable, "-m", "relay.tools.bench.agent_sim", str(root), str(nodes),
                     str(per_node), ATTEMPT_ID, str(group_size), str(shard), str(shards),
                     repr(started_at)], stdin=subprocess.PIPE))
                assert sims[-1].stdin is not None
                sims[-1].stdin.write(f"{secret}\n".encode())
                sims[-1].stdin.flush()
            handle: dict[str, Any] = {}
            aggregators: dict[str, Any] = {}
            for shard, sim in enumerate(sims):
                while not (root / ports_file(shard)).exists():
                    if sim.poll() is not None:
                        raise RuntimeError(f"agent_sim exited with {sim.returncode} before "
                                           "serving")
                    time.sleep(0.1)
                ports = json.loads((root / ports_file(shard)).read_text())
                handle.update({node: {**agent_handle(sim.pid), "port": port}
                               for node, port in ports["ports"].items()})
                aggregators.update(ports.get("aggregators") or {})
            (root / HANDLE_FILE).write_text(json.dumps({
                "nodes": dict(sorted(handle.items(), key=lambda kv: int(kv[0].split("-")[1]))),
                "aggregators": aggregators, "started_at": started_at,
                "attempt_id": ATTEMPT_ID}))
            yield root, sims
        finally:
            for sim in sims:
                sim.kill()
                sim.wait()


def strike(sims: list[subprocess.Popen[bytes]], fault: SimFault) -> None:
    """Script ``fault`` into every running simulator process."""
    for sim in sims:
        assert sim.stdin is not None
        sim.stdin.write((json.dumps(fault.__dict__) + "\n").encode())
        sim.stdin.flush()


class PollTimer:
    """Time every ``observe_attempt`` the trigger makes (one poll: every agent asked)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._real = triggers.observe_attempt

    def __enter__(self) -> PollTimer:
        def timed(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            began = time.perf_counter()
            try:
                return self._real(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - began)

        triggers.observe_attempt = timed
        return self

    def __exit__(self, *_exc: object) -> None:
        triggers.observe_attempt = self._real


def _trigger(root: Path, nodes: int, per_node: int, detection: Detection) -> SegmentWatchTrigger:
    node_ranks = {f"node-{n}": list(range(n * per_node, (n + 1) * per_node))
                  for n in range(nodes)}
    return SegmentWatchTrigger(attempt_dir=str(root), node_ranks=node_ranks,
                               detection=detection.model_dump(mode="json"),
                               heartbeat_interval_seconds=0.5,
                               poll_interval_seconds=detection.poll_interval)


async def _first_event(trigger: SegmentWatchTrigger, seconds: float,
                       then: Any = None) -> dict[str, Any] | None:  # noqa: ANN401
    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        return {}

    async def later() -> None:
        if then is not None:
            await asyncio.sleep(WARMUP_SECONDS)
            then()

    task = asyncio.ensure_future(later())
    try:
        return await asyncio.wait_for(first(), seconds)
    except TimeoutError:
        return None
    finally:
        task.cancel()


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_seconds(pid: int) -> float:
    """Return the CPU time (user + system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def healthy(nodes: int, per_node: int, seconds: float, detection: Detection,
            group_size: int = 0) -> dict[str, Any]:
    """Watch a fault-free job for ``seconds``: CPU, memory, poll latency, and every event
    (a false alarm ends a trigger's run: a fresh one goes on watching, as a retry's would)."""
    events: list[dict[str, Any]] = []
    with simulated(nodes, per_node, group_size) as (root, sims), PollTimer() as polls:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        sim0 = sum(_cpu_seconds(sim.pid) for sim in sims)
        while (left := seconds - (time.perf_counter() - wall0)) > 0:
            event = asyncio.run(_first_event(_trigger(root, nodes, per_node, detection), left))
            if event is not None:
                events.append(event)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        sim_cpu = sum(_cpu_seconds(sim.pid) for sim in sims) - sim0
        rss = _rss_mb()
    lat = sorted(polls.seconds) or [float("nan")]
    return {"cpu_share": cpu / wall, "sim_share": sim_cpu / wall, "rss_mb": rss,
            "polls": len(polls.seconds), "cpu_per_poll": cpu / max(len(polls.seconds), 1),
            "poll_p50": statistics.median(lat),
            "poll_p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "events": events}


def _said(events: list[dict[str, Any]]) -> str:
    if not events:
        return "none (correct)"
    kinds = [str((e.get("fault") or {}).get("kind") or e.get("status")) for e in events]
    return f"{len(events)} FALSE ALARM(S): " + ", ".join(kinds)


def detect(nodes: int, per_node: int, trial: Trial, detection: Detection,
           group_size: int = 0) -> dict[str, Any]:
    """Strike ``trial``'s fault after the warm-up; return the latency and what was called."""
    node, rank = f"node-{nodes - 1}", (nodes - 1) * per_node + 1
    struck: list[float] = []
    with simulated(nodes, per_node, group_size) as (root, sims):
        def fire() -> None:
            at = time.time()
            struck.append(at)
            strike(sims, SimFault(trial.kind, at, node=node if trial.on_node else None,
                                 rank=None if trial.on_node else rank))

        trigger = _trigger(root, nodes, per_node, detection)
        event = asyncio.run(_first_event(trigger, WARMUP_SECONDS + DETECT_WITHIN_SECONDS, fire))
    fault = (event or {}).get("fault") or {}
    right = fault.get("kind") == trial.expected and (
        fault.get("culprit_node") == node if trial.on_node else fault.get("culprit_rank") == rank)
    latency = fault["detected_at"] - struck[0] if fault and struck else None
    return {"latency": latency, "right": right, "called": fault.get("kind") or event}


def aggregator_frozen(nodes: int, per_node: int, detection: Detection,
                      group_size: int) -> list[dict[str, Any]]:
    """Freeze the last aggregator after the warm-up; return the events of QUIET_SECONDS."""
    with simulated(nodes, per_node, group_size) as (root, sims):
        name = f"aggregator-{(nodes - 1) // group_size}"
        trigger = _trigger(root, nodes, per_node, detection)
        event = asyncio.run(_first_event(trigger, WARMUP_SECONDS + QUIET_SECONDS, lambda: strike(
            sims, SimFault("stop_node", time.time(), node=name))))
    return [event] if event is not None else []


def measure(nodes: int, per_node: int, seconds: float, faults: bool = True,
            direct: bool = False) -> int:
    """Print one size's figures; return 0 if every figure is as it must be (silent when
    healthy, every fault named rightly)."""
    detection = default_detection()
    group_size = 0 if direct or nodes <= DIRECT_MAX_NODES else GROUP_SIZE
    h = healthy(nodes, per_node, seconds, detection, group_size)
    needed = h["cpu_per_poll"] / detection.poll_interval
    print(f"  {nodes:>5} nodes x {per_node} ranks: watcher CPU {h['cpu_per_poll'] * 1000:.0f} ms "
          f"per poll = {needed:.0%} of one core at the {detection.poll_interval:g}s poll (used: "
          f"{h['cpu_share']:.0%}), RSS {h['rss_mb']:.0f} MB, poll p50 "
          f"{h['poll_p50'] * 1000:.0f} ms / p99 {h['poll_p99'] * 1000:.0f} ms ({h['polls']} polls "
          f"in {seconds:g}s; the simulator used {h['sim_share']:.0%} of one core); fault-free "
          f"events: {_said(h['events'])}", flush=True)
    bad = bool(h["events"])
    for trial in TRIALS if faults else ():
        d = detect(nodes, per_node, trial, detection, group_size)
        said = f"{d['latency']:.2f}s" if d["latency"] is not None else "not detected"
        print(f"  {'':5} {trial.name:<12} detected after {said} "
              f"({d['called']}{'' if d['right'] else ': WRONG'})", flush=True)
        bad = bad or not d["right"]
    if faults and group_size:
        events = aggregator_frozen(nodes, per_node, detection, group_size)
        print(f"  {'':5} {'frozen aggregator':<12} events in {QUIET_SECONDS:g}s: "
              f"{_said(events)}", flush=True)
        bad = bad or bool(events)
    return int(bad)


def main(nodes: list[int] | None = None, seconds: float = 30.0, per_node: int = 8,
         smoke: bool = False, direct: bool = False) -> int:
    """Measure the watcher at each node count."""
    counts = nodes or [128, 256, 512, 1024]
    if smoke:
        counts, seconds = [8], 3.0  # and no fault runs: each takes a warm-up and more
    print(f"Watcher at scale{' (SMOKE: too small for figures)' if smoke else ''}: the real "
          f"SegmentWatchTrigger polling every {default_detection().poll_interval:g}s "
          f"({DEFAULT_POLICY.name if DEFAULT_POLICY.exists() else 'model defaults'}) over "
          f"simulated agents (relay.tools.bench.agent_sim, one process per group of nodes, HTTP "
          f"on loopback; load average {os.getloadavg()[0]:.1f}), "
          f"{seconds:g}s fault-free per size, then "
          f"{'(smoke: none)' if smoke else 'one'} run per fault struck after "
          f"{WARMUP_SECONDS:g}s. Compared with: one core, and issue 32's goal at 1,024 nodes "
          "x 8 ranks (<= 10% of one core, detection <= 2 s)", flush=True)
    return max(measure(n, per_node, seconds, faults=not smoke, direct=direct) for n in counts)
