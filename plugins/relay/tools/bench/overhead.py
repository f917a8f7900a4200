"""`relay bench overhead`: what Relay adds inside a rank, against the loop with no Relay code.

Three variants of the same job (2 nodes x 2 ranks of the tiny model, real DDP
over gloo), all started the same way (one ``torchrun --standalone``, 4 ranks),
so only the code inside the ranks differs:

- ``bare``: ``relay_train.baselines.bare_worker`` - the same model, data, optimizer and
  per-step seeding under plain DDP; no Relay code at all;
- ``relay``: the built-in job as it runs in a segment: the launch's entrypoint
  (``relay_train.examples.charlm``, through ``relay_train``'s Session) run by
  ``relay_train.baselines.torchrun_worker`` -> ``relay_train.worker.run_rank``: heartbeat thread,
  the ordered all-gather comm hook, the rescue and evidence responder threads,
  the drain check, the chaos checks and rank 0's checkpoint publisher (no
  periodic checkpoints; one at the end, as in every segment);
- ``relay`` and ``relay-no-heartbeat`` get the environment a Relay node agent
  gives its ranks (PyTorch's Flight Recorder on, for a hang's evidence);
- ``relay-no-heartbeat``: the same with the heartbeat thread off,
  ``relay-no-flight-rec``: with the Flight Recorder off, and
  ``bare+relay-ddp``: the bare loop with only Relay's DDP set-up and comm hook
  (one bucket, all-gather then an ordered sum, for bit-exact resumes), to show
  which piece the difference comes from.

Runs are interleaved round by round, in a rotating order, so every variant sees
the same machine; rank 0 reports steps/s over its training loop alone
(start-up excluded). Median and spread over the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from relay.tools.bench.common import Store, launch_config
from relay_train.device import Backend, rank_environment

VARIANTS = {"bare": ["relay_train.baselines.bare_worker"],
            "relay": ["relay_train.baselines.torchrun_worker"],
            "relay-no-heartbeat": ["relay_train.baselines.torchrun_worker"],
            "relay-no-flight-rec": ["relay_train.baselines.torchrun_worker"],
            "bare+relay-ddp": ["relay_train.baselines.bare_worker", "--relay-ddp"]}
# The environment a Relay node agent gives its ranks (relay_train.device.rank_environment:
# PyTorch's Flight Recorder, for a hang's collective trace), as in a segment.
WITH_AGENT_ENV = ("relay", "relay-no-heartbeat")


def _run(store: Store, root: Path, variant: str, steps: int, interval: float) -> float:
    cfg = launch_config(store, root, steps=steps,
                        heartbeat_interval=0.0 if variant == "relay-no-heartbeat" else interval)
    root.mkdir(parents=True, exist_ok=True)
    launch = root / "launch.json"
    cfg.write(launch)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if variant in WITH_AGENT_ENV:
        env.update(rank_environment(Backend.GLOO, root, deterministic=True))
    with (root / "torchrun.log").open("wb") as out:
        code = subprocess.run(
            [torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", str(cfg.world_size),
             "--max-restarts", "0", "-m", *VARIANTS[variant], "--launch", str(launch)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, timeout=1800, check=False,
        ).returncode
    if code != 0:
        raise RuntimeError(f"{variant} run failed (exit {code}); see {root / 'torchrun.log'}")
    return float(json.loads((root / "result.json").read_text())["steps_per_second"])


def main(rounds: int = 5, steps: int = 300, interval: float = 0.5, smoke: bool = False) -> int:
    """Run ``rounds`` interleaved rounds of every variant and print steps/s side by side."""
    if smoke:
        rounds, steps = 1, 40
    names = list(VARIANTS)
    rates: dict[str, list[float]] = {name: [] for name in names}
    print(f"Overhead benchmark{' (SMOKE: too short for figures)' if smoke else ''}: "
          f"{rounds} interleaved round(s) of {steps} steps, 2 nodes x 2 ranks under one "
          f"torchrun each run; heartbeat every {interval:g}s", flush=True)
    with tempfile.TemporaryDirectory(prefix="relay-bench-overhead-") as tmp:
        store = Store(Path(tmp))
        for i in range(rounds):
            order = names[i % len(names):] + names[: i % len(names)]
            for name in order:
                rate = _run(store, Path(tmp) / f"{name}-{i}", name, steps, interval)
                rates[name].append(rate)
                print(f"  round {i + 1} {name:19}: {rate:7.2f} steps/s", flush=True)
    bare = statistics.median(rates["bare"])
    print("\n  Compared with: the same loop with no Relay code (bare_worker.py, plain DDP)")
    print(f"  {'variant':19} {'median steps/s':>15} {'min-max':>17} {'vs bare':>9}")
    for name in names:
        values = rates[name]
        med = statistics.median(values)
        print(f"  {name:19} {med:15.2f} {min(values):8.2f}-{max(values):<8.2f} "
              f"{(med - bare) / bare:+9.1%}")
    print("  (negative = slower than bare; compare the gap with the min-max spread before "
          "reading anything into it)")
    return 0
