"""Start a node's agent where the node cannot read Relay's disk (a Slurm task).

The launcher hands the launch file over in the environment (:data:`ENV_LAUNCH_B64`,
base64 of its JSON, exported by the batch script and passed by ``srun`` to the task on
every node). This writes it (0600) into a node-local attempt folder, ``--home`` with
``{node}`` replaced by this node's name, then the attempt's id, with that folder as the
launch's ``attempt_dir`` (the ranks' logs, heartbeats and checkpoints go there); then it
becomes the node agent (``exec``: the same PID, so Slurm's signals reach the agent).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from pathlib import Path

from relay_train.protocol.env import ENV_LAUNCH_B64
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig

NODE_VARIABLES = ("SLURMD_NODENAME", "SLURM_TOPOLOGY_ADDR")  # this node's name in Slurm


def unpack(encoded: str, home: str, node: str) -> Path:
    """Write the launch file ``encoded`` into this node's attempt folder; return its path."""
    raw = json.loads(base64.b64decode(encoded))
    folder = Path(home.replace("{node}", node)) / raw["attempt_id"]
    raw["attempt_dir"] = str(folder)
    cfg = LaunchConfig.from_dict(raw)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    cfg.write(folder / LAUNCH_FILE)
    return folder / LAUNCH_FILE


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m relay_train.agent.unpack --home DIR [agent options]``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--home", required=True,
                        help="this node's own folder for attempts ({node}: the node's name)")
    parser.add_argument("--node", default=None, help="default: $SLURMD_NODENAME")
    parser.add_argument("--bind", default="0.0.0.0", help="the agent channel's address")
    parser.add_argument("--linger", default="0", help="see relay_train.agent.node --linger")
    args = parser.parse_args(argv)
    node = args.node or next((os.environ[v] for v in NODE_VARIABLES if os.environ.get(v)), "")
    encoded = os.environ.pop(ENV_LAUNCH_B64, "")
    if not node or not encoded:
        print(f"relay_train.agent.unpack: expected --node (or $SLURMD_NODENAME) and "
              f"${ENV_LAUNCH_B64}; found node={node!r}, launch {'set' if encoded else 'unset'}. "
              "Run it from the batch script Relay's Slurm launcher submits", file=sys.stderr)
        return 2
    launch = unpack(encoded, args.home, node)
    os.chdir(launch.parent)
    logs = launch.parent / "logs"
    logs.mkdir(exist_ok=True)
    out = os.open(logs / f"agent-{node}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for fd in (1, 2):  # the agent's log stays on its node, as with the local launcher
        os.dup2(out, fd)
    os.close(out)
    argv_agent = [sys.executable, "-m", "relay_train.agent.node", "--launch", str(launch),
                  "--node", node, "--bind", args.bind, "--linger", args.linger]
    os.execve(sys.executable, argv_agent, dict(os.environ))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
