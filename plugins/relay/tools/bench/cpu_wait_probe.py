"""What a loaded host does to the ranks' compute, and what is left once the CPU waits go.

Runs ``relay bench detect``'s job (2 nodes x 2 ranks of the tiny model, through the local
launcher) with the CPU oversubscribed 2x by busy processes (as ``relay bench detect
--load``), reads the ranks' heartbeats every 0.5 s for ``SECONDS`` (default 60) after
every rank has stepped, and prints, per rank and over all of them: the compute per step
the straggler rule used to judge (wall clock, smoothed), the share of it spent waiting
for a CPU (``cpu_wait_seconds``, from the kernel's run-queue figure:
:mod:`relay_train.cpu_wait`), and the compute less that wait, which the rule judges
now: min / median / max over the samples, and the max/min spread; then each rank's ratio
of that work to the other ranks' median per poll (the figure the straggler rule judges):
p50 / p90 / max, and how many polls were over 1.4x. ``--no-load``: the same job without
the busy processes.

Run: ``python -m relay.tools.bench.cpu_wait_probe [SECONDS] [--no-load]``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from relay.tools.bench.common import Store, launch_config, launched
from relay.tools.bench.detect_load import oversubscribed
from relay_train.protocol.heartbeat import Heartbeat, read_heartbeats

POLL_SECONDS = 0.5
OVER = 1.4  # a ratio worth counting: the straggler rule's floor is the policy's 1.5x
STARTUP_SECONDS = 300.0


def _figures(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    spread = ms[-1] / ms[0] if ms[0] > 0 else float("inf")
    return (f"{ms[0]:5.1f} / {statistics.median(ms):5.1f} / {ms[-1]:5.1f} ms "
            f"(max/min {spread:.1f}x)")


def _stepping(beats: dict[int, Heartbeat]) -> bool:
    return len(beats) == 4 and all(
        b.compute_seconds is not None and b.cpu_wait_seconds is not None for b in beats.values())


def sample(heartbeat_dir: Path, seconds: float) -> list[dict[int, Heartbeat]]:
    """Return the records read every poll for ``seconds`` once every rank has stepped."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while not _stepping(read_heartbeats(heartbeat_dir)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no rank stepped within {STARTUP_SECONDS:g}s")
        time.sleep(POLL_SECONDS)
    polls: list[dict[int, Heartbeat]] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(POLL_SECONDS)
        beats = read_heartbeats(heartbeat_dir)
        if _stepping(beats):
            polls.append(beats)
    return polls


def main(argv: list[str]) -> int:
    """Run the job, print the figures."""
    load = "--no-load" not in argv
    args = [a for a in argv if not a.startswith("--")]
    seconds = float(args[0]) if args else 60.0
    root = Path(tempfile.mkdtemp(prefix="relay-cpu-wait-"))
    cfg = launch_config(Store(root), root / "job", steps=10**7)
    with oversubscribed(2) if load else contextlib.nullcontext([]), launched(cfg):
        polls = sample(cfg.heartbeat_dir, seconds)
    print(f"CPU waits of the ranks' compute, 2 nodes x 2 ranks, {len(polls)} polls over "
          f"{seconds:g}s, {'CPU oversubscribed 2x' if load else 'no added load'}; load "
          f"average after: {os.getloadavg()[0]:.1f}")
    print("           compute (wall), min / median / max         waiting for a CPU   "
          "compute less the wait, min / median / max")
    for rank in sorted(polls[0]) if polls else []:
        beats = [p[rank] for p in polls]
        compute = [b.compute_seconds or 0.0 for b in beats]
        waited = [b.cpu_wait_seconds or 0.0 for b in beats]
        share = sum(waited) / sum(compute) if sum(compute) > 0 else 0.0
        print(f"  rank {rank}: {_figures(compute)}   {share:6.0%}              "
              f"{_figures([c - w for c, w in zip(compute, waited, strict=True)])}")
    print(f"  each rank's compute less the wait over the other ranks' median, per poll "
          f"(the straggler rule's ratio): p50 / p90 / max, polls over {OVER:g}x")
    for rank in sorted(polls[0]) if polls else []:
        ratios = sorted(_ratio(p, rank) for p in polls)
        over = sum(r > OVER for r in ratios)
        print(f"  rank {rank}: {statistics.median(ratios):.2f} / "
              f"{ratios[int(0.9 * (len(ratios) - 1))]:.2f} / {ratios[-1]:.2f}x, "
              f"{over} of {len(ratios)} polls over {OVER:g}x")
    return 0


def _ratio(beats: dict[int, Heartbeat], rank: int) -> float:
    """Return ``rank``'s compute less its CPU wait over the other ranks' median."""
    def work(b: Heartbeat) -> float:
        return (b.compute_seconds or 0.0) - (b.cpu_wait_seconds or 0.0)
    others = statistics.median(work(b) for r, b in beats.items() if r != rank)
    return work(beats[rank]) / others if others > 0 else 0.0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
