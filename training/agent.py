"""A node's agent: start the node's ranks, report their liveness, stop them on demand.

One agent per (simulated) node, started by a launcher in its own session and
process group, so that it outlives the Airflow task that started it (the task
defers) and can be stopped as a group. It rewrites ``status/<node>.json``
every second; the final record carries every rank's exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from training.heartbeat import ENV_HEARTBEAT_DIR, ENV_HEARTBEAT_INTERVAL, ENV_NODE, write_atomically
from training.launch import LaunchConfig

log = logging.getLogger("training.agent")

STATUS_INTERVAL_SECONDS = 1.0
TERM_GRACE_SECONDS = 5.0


class NodeAgent:
    """Supervise the ranks of one node."""

    def __init__(self, cfg: LaunchConfig, launch_file: Path, node: str) -> None:
        self.cfg = cfg
        self.node = node
        self.launch_file = launch_file
        self.status_file = cfg.status_dir / f"{node}.json"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.stopping = False

    def start_ranks(self) -> None:
        """Start one worker process per local rank."""
        self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
        for local_rank in range(self.cfg.ranks_per_node):
            rank = self.cfg.global_rank(self.node, local_rank)
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(local_rank),
                WORLD_SIZE=str(self.cfg.world_size),
                OMP_NUM_THREADS="1",
                **{
                    ENV_NODE: self.node,
                    ENV_HEARTBEAT_DIR: str(self.cfg.heartbeat_dir),
                    ENV_HEARTBEAT_INTERVAL: str(self.cfg.heartbeat_interval_seconds),
                },
            )
            with (self.cfg.log_dir / f"rank-{rank}.log").open("ab") as out:
                self.procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "training.worker", "--launch", str(self.launch_file)],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            log.info("started rank %d as pid %d", rank, self.procs[rank].pid)

    def write_status(self, state: str) -> None:
        """Write this node's status record."""
        record = {
            "node": self.node,
            "state": state,
            "agent_pid": os.getpid(),
            "pgid": os.getpgid(0),
            "rank_pids": {str(r): p.pid for r, p in self.procs.items()},
            "exit_codes": {str(r): p.returncode for r, p in self.procs.items()},
            "wall_clock": time.time(),
        }
        self.cfg.status_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.status_file, json.dumps(record))

    def stop_ranks(self, reason: str) -> None:
        """Terminate the ranks still running: SIGTERM, then SIGKILL after a grace period."""
        running = [p for p in self.procs.values() if p.poll() is None]
        if not running:
            return
        log.warning("stopping %d rank(s): %s", len(running), reason)
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_SECONDS
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def run(self) -> int:
        """Supervise until every rank has exited; return 0 only if all succeeded."""
        signal.signal(signal.SIGTERM, self._on_term)
        self.start_ranks()
        self.write_status("running")
        last_status = time.monotonic()
        while True:
            codes = {r: p.poll() for r, p in self.procs.items()}
            if self.stopping:
                self.stop_ranks("agent received SIGTERM")
            elif any(c not in (None, 0) for c in codes.values()):
                failed = {r: c for r, c in codes.items() if c not in (None, 0)}
                self.stop_ranks(f"rank(s) failed with exit codes {failed}")
            if all(p.poll() is not None for p in self.procs.values()):
                break
            if time.monotonic() - last_status >= STATUS_INTERVAL_SECONDS:
                self.write_status("running")
                last_status = time.monotonic()
            time.sleep(0.1)
        ok = all(p.returncode == 0 for p in self.procs.values())
        self.write_status("succeeded" if ok else "failed")
        log.info("all ranks exited: %s", {r: p.returncode for r, p in self.procs.items()})
        return 0 if ok else 1

    def _on_term(self, _signum: int, _frame: object) -> None:
        self.stopping = True


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m training.agent --launch FILE --node NAME``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--launch", type=Path, required=True)
    parser.add_argument("--node", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s agent {args.node} %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    cfg = LaunchConfig.read(args.launch)
    if args.node not in cfg.nodes:
        log.error("node %s: expected one of %s in %s", args.node, cfg.nodes, args.launch)
        return 2
    return NodeAgent(cfg, args.launch, args.node).run()


if __name__ == "__main__":
    sys.exit(main())
