"""Run one rank of a Relay launch file under torchrun (the goodput benchmark's baseline).

torchrun sets RANK and its own rendezvous (MASTER_ADDR/MASTER_PORT, read by
``env://``); the node a rank stands for follows from its rank, as in Relay's
launcher (ranks_per_node ranks per node, in order). The entrypoint is the
launch file's, exactly as a Relay node agent would run it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from relay_train.protocol.env import (
    ENV_HEARTBEAT_DIR,
    ENV_HEARTBEAT_INTERVAL,
    ENV_LAUNCH,
    ENV_NODE,
    ENV_NODE_AGENT_PID,
)
from relay_train.protocol.launch import LaunchConfig
from relay_train.worker import exit_now, run_rank


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``torchrun ... -m relay_train.baselines.torchrun_worker --launch FILE``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--launch", type=Path, required=True)
    args = parser.parse_args(argv)
    cfg = LaunchConfig.read(args.launch)
    rank = int(os.environ["RANK"])
    os.environ[ENV_NODE] = cfg.nodes[rank // cfg.ranks_per_node]
    os.environ[ENV_LAUNCH] = str(args.launch)
    os.environ[ENV_HEARTBEAT_DIR] = str(cfg.heartbeat_dir)
    os.environ[ENV_HEARTBEAT_INTERVAL] = str(cfg.heartbeat_interval_seconds)
    # torchrun gives every rank a session of its own: a frozen node must freeze the
    # torchrun agent (our parent) and its other ranks as well (see relay_train.inject).
    os.environ[ENV_NODE_AGENT_PID] = str(os.getppid())
    return run_rank(args.launch)


if __name__ == "__main__":
    exit_now(main())
