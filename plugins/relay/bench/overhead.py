"""`relay bench overhead`: training steps/s with heartbeats on versus off.

Same job (2 nodes x 2 ranks of the tiny model, real DDP over gloo), runs
interleaved on/off/off/on/... so both see the same machine; rank 0 reports
steps/s over its training loop alone (start-up excluded).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from relay.bench.common import Store, launch_config, launched
from relay.launchers.local import LaunchState, LocalLauncher


def _run(store: Store, root: Path, heartbeat_interval: float, steps: int) -> float:
    cfg = launch_config(store, root, steps=steps, heartbeat_interval=heartbeat_interval)
    launcher = LocalLauncher()
    with launched(cfg) as attempt:
        while (state := launcher.status(attempt).state) is LaunchState.RUNNING:
            time.sleep(0.2)
    if state is not LaunchState.SUCCEEDED:
        raise RuntimeError(f"benchmark run failed; see {attempt}/logs")
    return float(json.loads((attempt / "result.json").read_text())["steps_per_second"])


def main(pairs: int = 4, steps: int = 300, interval: float = 0.5) -> int:
    """Run ``pairs`` on/off pairs and print steps/s side by side."""
    rates: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="relay-bench-overhead-") as tmp:
        store = Store(Path(tmp))
        for i in range(pairs):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")
            for mode in order:
                rate = _run(store, Path(tmp) / f"{mode}-{i}", interval if mode == "on" else 0.0,
                            steps)
                rates[mode].append(rate)
                print(f"  run {i + 1} heartbeats {mode:3}: {rate:7.2f} steps/s", flush=True)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    spread = max(statistics.pstdev(rates["off"]) / off, statistics.pstdev(rates["on"]) / on)
    print(f"\nHeartbeat overhead: {pairs} interleaved pairs of {steps} steps, 2 nodes x 2 ranks, "
          f"heartbeat every {interval:g}s")
    print(f"  heartbeats off: {off:7.2f} steps/s (median)")
    print(f"  heartbeats on:  {on:7.2f} steps/s (median)")
    print(f"  slowdown:       {(off - on) / off:+.2%} (goal <= 1%); run-to-run spread "
          f"{spread:.1%} of the mean")
    return 0
