"""Run a segment attempt as one Slurm job: one node agent per allocated node.

The job is submitted with ``sbatch`` (its script on stdin, never a file on Relay's
disk) on exactly the nodes Relay's pool picked (``--nodelist``), one task per node
(``srun --ntasks-per-node=1``), each running :mod:`relay_train.agent.unpack`: the nodes
cannot read Relay's disk, so the script carries the launch file, and each task writes
it into its node's own attempt folder (``slurm.node_home``) and becomes the node agent.
The ranks meet at the first node; the agents answer on a port chosen per attempt, at
the address Slurm knows the node by (``NodeAddr``).

The attempt's handle is the Slurm job id, with the attempt's id (the job's
``--comment``, the fence: a job id that now names another job is never cancelled),
the nodes' addresses and the ports. A stop asks the agents over the channel and, when
they all said yes, waits for their job to end by itself (each stops its ranks and sends
their logs to MLflow first); else, or if it does not end, ``scancel --full -s TERM``,
waits the grace, then ``scancel --full -s KILL`` and ``scancel``. A node Slurm reports
DOWN, NOT_RESPONDING or FAIL is ``unresponsive`` (a ``node_unresponsive`` fault); a
quarantine drains the node in Slurm with the reason and expiry, and a release resumes it.
Every Slurm call: ``commands``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import shlex
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.core.attempt import Attempt, AttemptState
from relay.launchers import launch_record
from relay.launchers.agent_client import AgentChannel
from relay.launchers.base import LaunchStatus, NodeStatus, notice_of, overall_state
from relay.launchers.handle_file import HANDLE_FILE, HandleFile
from relay.launchers.slurm.commands import Slurm, SlurmError, SlurmJob, SlurmNode
from relay.spec.slurm import SlurmSpec
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.env import ENV_LAUNCH_B64, ENV_SHIELD_RANKS
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig, attempt_id_of
from relay_train.protocol.routes import (
    ERRORS,
    EXIT_CODES,
    SETTLED,
    STATE,
    NodeState,
)

if TYPE_CHECKING:
    from relay.nodes.pool import Quarantine

log = logging.getLogger(__name__)

NODE_CHECK_SECONDS = 2.0  # Slurm's node states are read at most this often
STOP_POLL_SECONDS = 0.2
# An agent asked to stop: its ranks' grace (5 s, SIGTERM to SIGKILL), then their logs to MLflow.
AGENT_STOP_SECONDS = 10.0
QUARANTINE_REASON = "relay:"  # how a drain by Relay starts its reason (only those are resumed)


def job_name(segment_dir: Path) -> str:
    """Return the Slurm job name of every attempt of a segment (stop_all finds them by it)."""
    key = "/".join(Path(segment_dir).parts[-3:])
    return "relay-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def batch_script(cfg: LaunchConfig, settings: SlurmSpec) -> str:
    """Return the batch script: the launch file in its environment, one agent task per node."""
    encoded = base64.b64encode(json.dumps(asdict(cfg), sort_keys=True).encode()).decode()
    task = [settings.python, "-m", "relay_train.agent.unpack", "--home", settings.node_home,
            "--linger", format(settings.linger, "g")]
    return "\n".join([
        "#!/bin/bash",
        f"# Relay attempt {cfg.attempt_id}: one node agent per node (relay_train.agent.unpack)",
        'export HOME="${HOME:-/tmp}"',
        f"export {ENV_LAUNCH_B64}={shlex.quote(encoded)}",
        # Slurm signals every process of the step: the ranks leave a SIGTERM to their agent
        # (a preemption notice, relay_train.agent.notice), which ends them with SIGUSR1.
        f"export {ENV_SHIELD_RANKS}=1",
        "exec srun --export=ALL --ntasks-per-node=1 --kill-on-bad-exit=0 " + shlex.join(task),
        "",
    ])


def node_status(node: str, job: SlurmJob | None, info: SlurmNode | None,
                report: dict[str, Any] | None, received_at: float | None) -> NodeStatus:
    """Return what one node of the attempt does, from Slurm's job and node states and its
    agent's latest report over the channel (pure: no call)."""
    status = NodeStatus(node, NodeState.STARTING, last_seen=received_at)
    if report is not None:
        status.state = NodeState(report.get(STATE, NodeState.RUNNING))
        status.exit_codes = {int(r): c for r, c in (report.get(EXIT_CODES) or {}).items()}
        status.errors = {int(r): str(t) for r, t in (report.get(ERRORS) or {}).items()}
        if received_at is not None:  # Slurm's --signal / preemption SIGTERM, as its agent took it
            status.notice = notice_of(report, received_at)
        failed = {r: c for r, c in status.exit_codes.items() if c not in (None, 0)}
        if failed:
            status.detail = f"ranks exited with {failed}"
    if status.state in SETTLED:
        return status  # its agent's final word stands, whatever Slurm did since
    problem = info.unresponsive if info is not None else f"Slurm no longer knows node {node}"
    if problem:
        status.state, status.detail = NodeState.UNRESPONSIVE, problem
    elif job is None:
        status.state, status.detail = NodeState.FAILED, "its Slurm job is gone"
    elif job.ended:
        status.state = NodeState.FAILED
        status.detail = (f"Slurm job {job.job_id} ended {job.state} ({job.reason}, exit "
                         f"{job.exit_code}) before this node's agent reported its ranks' end")
    elif job.state == "PENDING":
        status.state, status.detail = NodeState.STARTING, f"job pending: {job.reason}"
    return status


class SlurmLauncher(HandleFile):
    """Start, watch and stop segment attempts as Slurm jobs."""

    name = "slurm"
    continuity = None  # a job's agents end with it: every attempt launches afresh

    def __init__(self, settings: SlurmSpec | None = None, slurm: Slurm | None = None) -> None:
        self.settings = settings or SlurmSpec()
        env = ({**os.environ, "SLURM_CONF": self.settings.slurm_conf}
               if self.settings.slurm_conf else None)
        self.slurm = slurm or Slurm(env)
        HandleFile.__init__(self)
        self._cluster: tuple[float, dict[str, SlurmNode]] | None = None

    def config(self) -> dict[str, Any]:
        """Return the factory's description of this launcher."""
        return {"kind": self.name, **self.settings.model_dump()}

    def slots(self, nodes: list[str]) -> list[str]:
        """Return ``nodes``: Relay's node pool names Slurm's nodes (RELAY_NODES)."""
        return list(nodes)

    def host_of(self, attempt: Attempt, node: str) -> str:
        """Return ``node``: a Slurm node is the machine a quarantine names."""
        return node

    def cluster(self, fresh: bool = False) -> dict[str, SlurmNode]:
        """Return Slurm's nodes (read at most every :data:`NODE_CHECK_SECONDS`)."""
        now = time.monotonic()
        if fresh or self._cluster is None or now - self._cluster[0] >= NODE_CHECK_SECONDS:
            self._cluster = (now, self.slurm.nodes())
        return self._cluster[1]

    # -- launch ------------------------------------------------------------------------

    def launch(self, cfg: LaunchConfig) -> Attempt:
        """Submit the attempt's job on ``cfg.nodes``; return the attempt."""
        from relay.nodes.pool import NodePool

        held = NodePool().quarantines()
        self.enforce_quarantines(held)
        cluster = self.cluster(fresh=True)
        unknown = [n for n in cfg.nodes if n not in cluster]
        if unknown:
            raise SlurmError(f"nodes {unknown}: expected Relay's node pool (RELAY_NODES) to name "
                             f"Slurm nodes; Slurm has {sorted(cluster)}. Set RELAY_NODES to "
                             "Slurm node names")
        unfit = {n: "+".join(sorted(cluster[n].states)) + (f" ({cluster[n].reason})"
                                                           if cluster[n].reason else "")
                 for n in cfg.nodes if cluster[n].unfit}
        if unfit:
            raise SlurmError(f"nodes {sorted(unfit)}: expected them up and not drained in Slurm; "
                             f"found {unfit}. The job would wait for them: quarantine them in "
                             "Relay (`relay nodes quarantine NODE`) or resume them in Slurm")
        low, high = self.settings.ports
        agent_port, master_port = random.sample(range(low, high), 2)
        root = cfg.root
        cfg = replace(cfg, attempt_id=cfg.attempt_id or attempt_id_of(root),
                      channel_secret=new_secret(),  # fresh for every attempt
                      agent_ports={n: agent_port for n in cfg.nodes},
                      master_addr=cfg.nodes[0], master_port=master_port,
                      logs_to_mlflow=True)  # the rank logs stay on the nodes' own disks
        root.mkdir(parents=True, exist_ok=True)
        cfg.write(root / LAUNCH_FILE)  # Relay's copy (0600): the channel secret, for its reports
        excluded = sorted(n for n in held if n in cluster and n not in cfg.nodes)
        options = [f"--job-name={job_name(root.parent)}", f"--comment={cfg.attempt_id}",
                   f"--nodes={len(cfg.nodes)}", f"--nodelist={','.join(cfg.nodes)}",
                   "--ntasks-per-node=1", "--output=/dev/null", "--chdir=/", "--no-requeue",
                   "--export=NONE",  # none of Relay's environment: the launch file says it all
                   *([f"--exclude={','.join(excluded)}"] if excluded else []),
                   *([f"--partition={self.settings.partition}"] if self.settings.partition
                     else []),
                   *self.settings.sbatch_args]
        job_id = self.slurm.submit(batch_script(cfg, self.settings), options)
        handle = {"job_id": job_id, "attempt_id": cfg.attempt_id, "started_at": time.time(),
                  "addresses": {n: cluster[n].address for n in cfg.nodes}, "port": agent_port}
        (root / HANDLE_FILE).write_text(json.dumps(handle))
        log.info("Slurm job %s: attempt %s on %s (agents on port %d); excluded: %s", job_id,
                 cfg.attempt_id, ",".join(cfg.nodes), agent_port, ", ".join(excluded) or "none")
        return Attempt(root, nodes=tuple(cfg.nodes))

    def _job(self, handle: dict[str, Any]) -> SlurmJob | None:
        """Return the handle's job if it is still this attempt's (the fence), else None."""
        job = self.slurm.job(str(handle["job_id"]))
        if job is not None and job.comment != handle.get("attempt_id"):
            log.warning("Slurm job %s now belongs to %r, not attempt %s: leaving it alone",
                        job.job_id, job.comment, handle.get("attempt_id"))
            return None
        return job

    # -- watch -------------------------------------------------------------------------

    def channel(self, attempt: Attempt) -> AgentChannel:
        """Return the channel to the attempt's agents (at their nodes' Slurm addresses)."""
        root = attempt.runs_in
        if root not in self._channels:
            handle = self.handle(attempt)
            port = handle.get("port")
            found = handle.get("addresses") or {}
            addresses = {n: f"http://{a}:{port}" for n, a in found.items()}
            self._channels[root] = AgentChannel(
                str(handle.get("attempt_id") or attempt_id_of(root)), addresses,
                self._secret(root))
        return self._channels[root]

    @staticmethod
    def _secret(root: Path) -> str:
        try:
            return launch_record.config_of(root).channel_secret
        except (OSError, ValueError, TypeError) as exc:
            log.error("No channel secret for %s: expected its launch record or %s, found "
                      "neither (%s); its agents will refuse this worker", root.name,
                      root / LAUNCH_FILE, exc)
            return ""

    def status(self, attempt: Attempt) -> LaunchStatus:
        """Read the job's and its nodes' states from Slurm, and ask the agents."""
        handle = self.handle(attempt)
        if not handle:
            log.warning("No Slurm handle for %s: the attempt is gone", attempt.runs_in)
            return LaunchStatus(AttemptState.FAILED, {})
        job = self._job(handle)
        cluster = self.cluster()
        channel = self.channel(attempt)
        live = [n for n in channel.addresses
                if not (channel.reports.get(n) and channel.reports[n].record.get(STATE) in SETTLED)]
        if job is not None and job.state == "RUNNING":
            channel.poll(live)
        channel.keep_node_records(attempt.runs_in)
        nodes = {}
        for node in handle.get("addresses") or {}:
            report = channel.reports.get(node)
            nodes[node] = node_status(node, job, cluster.get(node),
                                      report.record if report else None,
                                      report.received_at if report else None)
            nodes[node].round_trip = report.round_trip if report else None
        return LaunchStatus(overall_state(nodes), nodes, dict(channel.beats),
                            list(channel.refused), set(channel.crossed))

    # -- stop --------------------------------------------------------------------------

    def stop(self, attempt: Attempt, grace_seconds: float = 5.0) -> list[str]:
        """Ask the agents to stop; unless they all said yes and their job then ended by itself
        (:data:`AGENT_STOP_SECONDS`), ``scancel`` TERM, the grace, KILL; return what is left
        (the job, if Slurm still runs it)."""
        handle = self.handle(attempt)
        if not handle:
            return []
        job = self._job(handle)
        if job is None or job.ended:
            return []
        if job.state == "RUNNING":
            channel = self.channel(attempt)
            asked = channel.ask_to_stop()
            # Every agent stops its ranks, sends their logs to MLflow and exits: a signal
            # before then would end the job (and the logs) with it. A silent one cannot.
            if asked and asked == set(channel.addresses) and self._ends(handle, AGENT_STOP_SECONDS):
                return []
        return self._cancel(job.job_id, handle, grace_seconds)

    def _ends(self, handle: dict[str, Any], seconds: float) -> bool:
        """Return whether the handle's job ends by itself within ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            job = self._job(handle)
            if job is None or job.ended or job.state == "COMPLETING":
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(STOP_POLL_SECONDS)

    def _cancel(self, job_id: str, handle: dict[str, Any], grace_seconds: float) -> list[str]:
        for sig, wait in (("TERM", grace_seconds), ("KILL", grace_seconds)):
            job = self._job(handle)
            if job is None or job.ended:
                return []
            if job.state == "PENDING":
                break
            self.slurm.cancel(job_id, sig)
            log.info("Slurm job %s: sent SIG%s to every process", job_id, sig)
            deadline = time.monotonic() + wait
            while True:
                job = self._job(handle)
                if job is None or job.ended:
                    return []
                if time.monotonic() >= deadline:
                    break
                time.sleep(STOP_POLL_SECONDS)
        self.slurm.cancel(job_id)  # ends the job itself (and a pending one)
        job = self._job(handle)
        if job is None or job.ended or job.state in ("COMPLETING", "CANCELLED"):
            return []
        log.error("Slurm job %s still %s after scancel", job_id, job.state)
        return [f"slurm job {job_id} ({job.state})"]

    def stop_all(self, segment_dir: Path) -> list[str]:
        """Stop every attempt of a segment this launcher recorded in ``segment_dir``."""
        survivors: list[str] = []
        if Path(segment_dir).is_dir():
            for folder in sorted(Path(segment_dir).iterdir()):
                if (folder / HANDLE_FILE).exists():
                    survivors += self.stop(Attempt(folder))
        return survivors

    # -- quarantine --------------------------------------------------------------------

    def enforce_quarantines(self, held: dict[str, Quarantine]) -> None:
        """Drain quarantined nodes in Slurm (reason: Relay's, with the expiry); resume the
        nodes Relay drained whose quarantine is over."""
        now = time.time()
        for name, node in self.cluster(fresh=True).items():
            quarantine = held.get(name)
            ours = node.reason.startswith(QUARANTINE_REASON)
            drained = bool(node.states & {"DRAIN", "DRAINED", "DRAINING"})
            if quarantine is not None and quarantine.active(now):
                if not (drained and ours):
                    until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(quarantine.until))
                    reason = f"{QUARANTINE_REASON} {quarantine.reason} (until {until})"
                    self.slurm.drain(name, reason)
                    log.warning("Slurm node %s drained: %s", name, reason)
            elif drained and ours:
                self.slurm.resume(name)
                log.warning("Slurm node %s resumed: its Relay quarantine is over", name)
        self._cluster = None
