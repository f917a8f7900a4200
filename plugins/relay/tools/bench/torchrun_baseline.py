"""The goodput benchmark's baseline: what a team has without Relay.

One ``torchrun`` per node (static rendezvous, ``--max-restarts 0``), the same
training loop (``relay_train.baselines.torchrun_worker``), and a supervisor loop around
whole torchrun runs: when a torchrun exits non-zero, every other one is ended
(a frozen node at once, a live one after a 3 s grace to exit by itself), and
the job starts again from the last checkpoint logged to MLflow, on fresh
processes and a fresh port.

Why not torchrun's own ``--max-restarts``: on this machine (torch 2.13, gloo)
every in-job restart failed in ``init_process_group`` with "Gloo
connectFullMesh failed ... Connection refused" (peers' stale addresses), with
both the static and the ``--standalone`` rendezvous (upstream pytorch#167288
reports the same with NCCL); see /work/shared/ENVIRONMENT.md.

The supervisor gets the same node pool as Relay. Before a restart it checks
that each node answers (here: its torchrun agent is not frozen), and replaces a
node that does not with the next unused one; it cannot tell a slow node from a
healthy one, so a slow node stays. Nothing watches heartbeats: a hang or a
frozen node ends only when gloo's collective timeout fires in the peers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from relay.core.checkpoint_keys import checkpoint_keys
from relay.launchers.local.ports import listen_port
from relay.lineage.report import chaos_strikes, first_step_at
from relay_train.inject import child_pids
from relay_train.protocol import pids
from relay_train.protocol.heartbeat import read_heartbeats
from relay_train.protocol.injection import LASTING
from relay_train.protocol.launch import LaunchConfig

LIVE_GRACE_SECONDS = 3.0  # a healthy torchrun tears its ranks down and exits in ~2 s
# Which mechanism ends a torchrun run after each injected fault kind (ENVIRONMENT.md).
ENDED_BY = {"hang": "collective timeout", "stop_node": "collective timeout",
            "stop_rank": "collective timeout", "crash": "connection reset"}


@dataclass
class Recovery:
    """One fault the baseline met and what restarting cost."""

    kind: str
    ended_by: str
    strike_at: float | None
    failed_at: float
    reached_step: int
    lost_steps: int | None = None  # known once the restart knows where it resumes
    resumed_at: float | None = None

    @property
    def fault_to_resume(self) -> float | None:
        """Seconds from the fault to the restarted job's first step."""
        if self.resumed_at is None or self.strike_at is None:
            return None
        return self.resumed_at - self.strike_at

    @property
    def detected_after(self) -> float | None:
        """Seconds from the fault to the first torchrun exiting."""
        return None if self.strike_at is None else self.failed_at - self.strike_at


@dataclass
class BaselineRun:
    """What one supervised torchrun job cost."""

    wall: float = 0.0
    started: float = 0.0  # wall-clock time the supervisor started the job
    ok: bool = False
    attempts: int = 0
    recoveries: list[Recovery] = field(default_factory=list)
    nodes_used: list[str] = field(default_factory=list)


def _descendants(pid: int) -> list[int]:
    parents = child_pids()
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.extend(children)
        todo.extend(children)
    return found


def _frozen(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return  # reaped: its PID may be another process's now (its ranks left its tree)
    tree = [(pid, pids.start_time(pid)) for pid in [proc.pid, *_descendants(proc.pid)]]
    for pid, started in tree:  # as found just now: a PID reused since is left alone
        pids.signal_process(pid, started, signal.SIGKILL)
    proc.wait()


def _supervise(procs: dict[str, subprocess.Popen[bytes]]) -> tuple[bool, float, set[str]]:
    """Wait for the torchruns; end them all on the first failure, and on the way out of
    an interrupted benchmark (SIGTERM, Ctrl-C), which would leave them training.

    Return (all succeeded, when the first failure was seen, the nodes found frozen).
    """
    try:
        return _wait_for(procs)
    except BaseException:
        for proc in procs.values():
            _kill_tree(proc)
        raise


def _wait_for(procs: dict[str, subprocess.Popen[bytes]]) -> tuple[bool, float, set[str]]:
    while True:
        codes = {n: p.poll() for n, p in procs.items()}
        if all(c == 0 for c in codes.values()):
            return True, time.time(), set()
        if any(c not in (None, 0) for c in codes.values()):
            break
        time.sleep(0.2)
    failed_at = time.time()
    frozen = {n for n, p in procs.items() if p.poll() is None and _frozen(p.pid)}
    deadline = time.monotonic() + LIVE_GRACE_SECONDS
    for node, proc in procs.items():
        if proc.poll() is None and node not in frozen:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for proc in procs.values():
        _kill_tree(proc)  # also the ranks: torchrun gives each a session of its own
    return False, failed_at, frozen


def _start(cfg: LaunchConfig, launch: Path) -> dict[str, subprocess.Popen[bytes]]:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    procs = {}
    for index, node in enumerate(cfg.nodes):
        out = (cfg.root / f"torchrun-{node}.log").open("wb")
        procs[node] = subprocess.Popen(
            [torchrun, "--nnodes", str(len(cfg.nodes)), "--node-rank", str(index),
             "--nproc-per-node", str(cfg.ranks_per_node), "--master-addr", cfg.master_addr,
             "--master-port", str(cfg.master_port), "--max-restarts", "0",
             "-m", "relay_train.baselines.torchrun_worker", "--launch", str(launch)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
        )
        out.close()
    return procs


def _cause(attempt_dir: Path) -> tuple[str, float | None]:
    """Return the injected one-shot fault that ended an attempt, and when it struck."""
    for strike in chaos_strikes(attempt_dir):
        if strike["kind"] not in LASTING:
            return str(strike["kind"]), float(strike["at"])
    return "unknown", None


def run_baseline(
    job_dir: Path, job: dict[str, Any], schedule: list[dict[str, Any]], pool: list[str],
    collective_timeout: float, tracking_uri: str | None = None,
) -> BaselineRun:
    """Run the job under supervised torchrun until it finishes (or 30 restarts);
    ``tracking_uri``: the MLflow store both sides log to (default: one of its own, on disk)."""
    from relay.lineage.store import Lineage

    lineage = Lineage(tracking_uri or f"sqlite:///{job_dir / 'mlflow.db'}", job_dir / "artifacts")
    lineage.ensure_store()  # the store's tables exist before the clock starts, as Relay's do
    nodes, spare = list(pool[: job["nodes"]]), list(pool[job["nodes"]:])
    run = BaselineRun(nodes_used=list(nodes))
    started = run.started = time.time()
    # As preflight: one MLflow run per job run, named by its folder's last two parts (the
    # repeat and the run), unique in a store that several repeats share.
    parent = lineage.parent_run("goodput-baseline", "baseline",
                                f"{job_dir.parent.name}/{job_dir.name}")
    for attempt in range(1, 31):
        attempt_dir = job_dir / "segment-000" / f"try-{attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        latest = lineage.latest_valid_checkpoint(parent, attempt_dir / "resume")
        resume_step = latest.manifest.step if latest else 0
        if attempt == 1 and latest is not None:  # it would "finish" without training
            raise RuntimeError(
                f"baseline {job_dir}: expected a new MLflow run, found run {parent} with a "
                f"checkpoint at step {resume_step} in {lineage.tracking_uri}; give each "
                "baseline run a folder of its own (its repeat and run name the MLflow run)")
        if run.recoveries:
            last = run.recoveries[-1]
            last.lost_steps = max(last.reached_step - resume_step, 0)
        run_id = lineage.attempt_run(parent, 0, attempt, {"resume_step": resume_step})
        cfg = LaunchConfig(
            job="goodput-baseline", seed=job["seed"], model=job["model"], data=job["data"],
            optimizer=job["optimizer"], start_step=resume_step, end_step=job["steps"],
            checkpoint_every=job["every"], nodes=nodes, ranks_per_node=job["ranks_per_node"],
            master_addr="127.0.0.1", master_port=listen_port(), tracking_uri=lineage.tracking_uri,
            run_id=run_id, attempt_dir=str(attempt_dir), attempt=attempt, segment=0,
            collective_timeout_seconds=collective_timeout, chaos=schedule,
            resume=replace(latest.resume_from(), artifact="") if latest else None,
            checkpoint_keys=checkpoint_keys().to_dict(),
        )
        launch = attempt_dir / "launch.json"
        cfg.write(launch)
        ok, failed_at, frozen = _supervise(_start(cfg, launch))
        run.attempts = attempt
        if run.recoveries:
            run.recoveries[-1].resumed_at = first_step_at(attempt_dir)
        if ok:
            run.ok = True
            break
        kind, strike_at = _cause(attempt_dir)
        beats = read_heartbeats(attempt_dir / "heartbeats")
        reached = max((b.step for b in beats.values()), default=resume_step)
        run.recoveries.append(Recovery(kind, ENDED_BY.get(kind, "exit"), strike_at, failed_at,
                                       reached))
        for node in sorted(frozen):  # the supervisor's node check: an unanswering node is out
            if not spare:
                raise RuntimeError(f"baseline: node {node} froze and no spare node is left")
            replacement = spare.pop(0)
            nodes[nodes.index(node)] = replacement
            run.nodes_used.append(replacement)
    run.wall = time.time() - started
    (job_dir / "outcome.json").write_text(json.dumps(
        {"ok": run.ok, "wall": run.wall, "attempts": run.attempts,
         "recoveries": [r.__dict__ for r in run.recoveries]}, indent=2))
    return run
