"""Run one rank of ``training.worker`` under torchrun (the goodput benchmark's baseline).

torchrun sets RANK and its own rendezvous; the node a rank stands for follows
from its rank, as in Relay's launcher (ranks_per_node ranks per node, in order).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from training.chaos import ENV_NODE_AGENT_PID
from training.heartbeat import ENV_NODE
from training.launch import LaunchConfig
from training.worker import ENV_INIT_METHOD, exit_now, train


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``torchrun ... -m training.torchrun_worker --launch FILE``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--launch", type=Path, required=True)
    args = parser.parse_args(argv)
    cfg = LaunchConfig.read(args.launch)
    rank = int(os.environ["RANK"])
    node = cfg.nodes[rank // cfg.ranks_per_node]
    os.environ[ENV_NODE] = node
    os.environ[ENV_INIT_METHOD] = "env://"
    # torchrun gives every rank a session of its own: a frozen node must freeze the
    # torchrun agent (our parent) and its other ranks as well (see training.chaos).
    os.environ[ENV_NODE_AGENT_PID] = str(os.getppid())
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {node} rank{rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    train(cfg, rank, node)
    return 0


if __name__ == "__main__":
    exit_now(main())
