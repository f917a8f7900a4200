"""Run a segment attempt as local processes: one node agent per simulated node.

Each agent starts in its own session, so its process group (agent + ranks)
outlives the Airflow task that launched it while the task defers, and can be
stopped as a whole by PGID. The launch record is the one file Relay keeps in
the attempt folder, and only this launcher: ``handle.json`` (the attempt's id,
PIDs, PGIDs, the agents' start times and channel ports); the same handle travels
with the attempt (:meth:`LocalLauncher.handle`, :meth:`LocalLauncher.attach`, see
:mod:`relay.launchers.launch_record`), so a task that finds no such file still finds its
agents. What the agents and
ranks say (state, exit codes, heartbeats, answers) comes over the channel
(:mod:`relay.launchers.agent_client`), as on a cluster. Every signal goes through
:mod:`relay_train.protocol.pids`, so a PID reused by another process is never touched.

Test hook: ``RELAY_TEST_PARTITIONED_NODES`` (comma-separated node names) makes
:meth:`LocalLauncher.stop` unable to reach those nodes, as a network partition
would (no channel request, no signal), for the fencing tests.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.core.attempt import Attempt, AttemptState
from relay.core.exceptions import NotOursError
from relay.core.proctree import group_members
from relay.launchers import launch_record
from relay.launchers.agent_client import AgentChannel
from relay.launchers.agent_groups import Group
from relay.launchers.base import LaunchStatus, NodeStatus, notice_of, overall_state
from relay.launchers.handle_file import HANDLE_FILE, HandleFile
from relay.launchers.local.ports import free_port, listen_ports
from relay.launchers.local.signals import LocalSignals
from relay.launchers.local.warm_agents import (
    LINGER_SECONDS,
    STANDBY_DIR,
)
from relay.launchers.local.warm_start import LocalWarmStart
from relay_train.protocol import pids
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.heartbeat import write_atomically
from relay_train.protocol.launch import LAUNCH_FILE, STOP_FILE, LaunchConfig, attempt_id_of
from relay_train.protocol.routes import (
    ERRORS,
    EXIT_CODES,
    STATE,
    NodeState,
)

if TYPE_CHECKING:
    from relay.nodes.pool import Quarantine

__all__ = [
    "LINGER_SECONDS", "STANDBY_DIR", "LaunchStatus", "LocalLauncher", "NodeStatus",
    "NotOursError", "free_port", "group_members",
]

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 5.0
ENV_PARTITIONED = "RELAY_TEST_PARTITIONED_NODES"  # test hook: nodes stop() cannot reach
STOP_ASK_TIMEOUT_SECONDS = 0.5
STOP_POLL_SECONDS = 0.02  # a stop looks this often whether the attempt's processes are gone


def channel_secret(root: Path) -> str:
    """Return the channel secret of the attempt at ``root``: from its launch record restored
    in this process (the secret unsealed), else its launch file (0600, on the machine that
    launched it); "" when there is neither (every agent refuses)."""
    try:
        return launch_record.config_of(root).channel_secret
    except (OSError, ValueError, TypeError) as exc:
        log.error("No channel secret for %s: expected its launch record or %s, found neither "
                  "(%s); its agents will refuse this worker", root, root / LAUNCH_FILE, exc)
        return ""


def agent_handle(pid: int) -> dict[str, int | None]:
    """Return the handle of an agent that leads its own process group: PID, PGID, start time."""
    return {"pid": pid, "pgid": pid, "started": pids.start_time(pid)}


class LocalLauncher(HandleFile, LocalSignals, LocalWarmStart):
    """Start, watch and stop segment attempts as local process groups."""

    name = "local"

    def __init__(self) -> None:
        from relay.launchers.local.continuity import LocalContinuity

        HandleFile.__init__(self)
        self.continuity = LocalContinuity(self)

    def config(self) -> dict[str, Any]:
        """Return the factory's description of this launcher."""
        return {"kind": self.name}

    def slots(self, nodes: list[str]) -> list[str]:
        """Return ``nodes``: a simulated node is its own slot."""
        return list(nodes)

    def host_of(self, attempt: Attempt, node: str) -> str:
        """Return ``node``: a simulated node is its own host."""
        return node

    def enforce_quarantines(self, held: dict[str, Quarantine]) -> None:
        """Do nothing: the node pool's selection already keeps quarantined nodes out."""

    def launch(self, cfg: LaunchConfig) -> Attempt:
        """Write the launch file, start one agent per node; return the attempt.

        The ranks meet on loopback at a free port. A node with a standby agent in the
        segment's standby folder (:data:`STANDBY_DIR`, where this launcher's warm starts
        put them) gets it (already preloaded), else one the run's resident agent forks
        now (preloaded too; waited for while it preloads), else a new agent; the
        standbys nobody took are stopped afterwards.
        """
        root = cfg.root
        # Fresh for every attempt (a retry after a taken port gets another): below the
        # kernel's ephemeral range, where no outgoing connection takes them meanwhile.
        *agent_ports, master_port = listen_ports(len(cfg.nodes) + 1)
        cfg = replace(cfg, attempt_id=cfg.attempt_id or attempt_id_of(root),
                      channel_secret=new_secret(),  # fresh for every attempt
                      agent_ports=dict(zip(cfg.nodes, agent_ports, strict=True)),
                      master_addr=cfg.master_addr or "127.0.0.1",
                      master_port=cfg.master_port or master_port)
        standby_dir = root.parent / STANDBY_DIR
        for sub in (root, cfg.log_dir, cfg.heartbeat_dir):
            sub.mkdir(parents=True, exist_ok=True)
        launch_file = root / LAUNCH_FILE
        cfg.write(launch_file)
        handle: dict[str, dict[str, int | None]] = {}
        self._from_resident(standby_dir, cfg.nodes)
        for node in cfg.nodes:
            pid = self._take(standby_dir, node, launch_file)
            if pid is not None:
                handle[node] = {**agent_handle(pid), "standby": True,
                                "port": cfg.agent_ports[node]}
                log.info("Handed %s to its standby agent (pid %d, preloaded)", node, pid)
                continue
            with (cfg.log_dir / f"agent-{node}.log").open("ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "relay_train.agent.node", "--launch", str(launch_file),
                     "--node", node, "--linger", str(LINGER_SECONDS)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=root,
                    start_new_session=True,
                )
            handle[node] = {**agent_handle(proc.pid), "port": cfg.agent_ports[node]}
            log.info("Started agent for %s as pid %d (channel port %d)", node, proc.pid,
                     cfg.agent_ports[node])
        (root / HANDLE_FILE).write_text(json.dumps({"nodes": handle, "started_at": time.time(),
                                                    "attempt_id": cfg.attempt_id}))
        self.release_standbys(standby_dir)
        return Attempt(root, nodes=tuple(cfg.nodes))

    def _handle(self, attempt: Attempt) -> dict[str, dict[str, int | None]]:
        try:
            nodes = self.handle(attempt)["nodes"]
            return {
                str(n): {"pid": int(ids["pid"]), "pgid": int(ids["pgid"]),
                         "started": None if ids.get("started") is None else int(ids["started"]),
                         "port": None if ids.get("port") is None else int(ids["port"])}
                for n, ids in nodes.items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def _groups(self, attempt: Attempt) -> list[Group]:
        """Return the attempt's aggregators (``aggregators`` in its handle: name -> port and
        nodes; relay.launchers.agent_groups), if it has any."""
        try:
            return [Group(str(name), f"http://127.0.0.1:{int(g['port'])}",
                          tuple(str(n) for n in g["nodes"]))
                    for name, g in (self.handle(attempt).get("aggregators") or {}).items()]
        except (KeyError, TypeError, ValueError, AttributeError):
            log.warning("The aggregators in the handle of %s are unreadable: asking every agent "
                        "directly", attempt.runs_in)
            return []

    def channel(self, attempt: Attempt) -> AgentChannel:
        """Return the channel to the attempt's agents (on loopback, at the recorded ports)."""
        root = attempt.runs_in
        if root not in self._channels:
            attempt_id = str(self.handle(attempt).get("attempt_id") or attempt_id_of(root))
            addresses = {n: f"http://127.0.0.1:{ids['port']}"
                         for n, ids in self._handle(attempt).items() if ids["port"] is not None}
            self._channels[root] = AgentChannel(attempt_id, addresses, channel_secret(root),
                                                groups=self._groups(attempt))
        return self._channels[root]

    def status(self, attempt: Attempt) -> LaunchStatus:
        """Ask the agents over the channel, and check their PIDs; never blocks for long."""
        channel = self.channel(attempt)
        channel.poll()
        nodes: dict[str, NodeStatus] = {}
        running: dict[tuple[int | None, int | None], bool] = {}  # each process looked up once
        for node, ids in self._handle(attempt).items():
            report = channel.reports.get(node)  # its latest answer, if it ever answered
            process = (ids["pid"], ids["started"])
            if process not in running:  # (one simulator process serves every node: the bench)
                running[process] = pids.is_running(ids["pid"], ids["started"])
            alive = running[process]
            if report is None:
                state = NodeState.STARTING if alive else NodeState.FAILED
                detail = "" if alive else "agent exited before reporting any status"
                nodes[node] = NodeStatus(node, state, detail=detail)
                continue
            record = report.record
            codes = {int(r): c for r, c in record.get(EXIT_CODES, {}).items()}
            state = NodeState(record.get(STATE, NodeState.RUNNING))
            detail = ""
            if state in (NodeState.STARTING, NodeState.RUNNING) and not alive:
                state, detail = NodeState.FAILED, "agent died without a final status (killed?)"
            errors = {int(r): str(t) for r, t in (record.get(ERRORS) or {}).items()}
            nodes[node] = NodeStatus(node, state, codes, detail, report.received_at,
                                     errors=errors, notice=notice_of(record, report.received_at),
                                     round_trip=report.round_trip)
        return LaunchStatus(overall_state(nodes), nodes, dict(channel.beats),
                            list(channel.refused), set(channel.crossed))

    def heartbeats(self, attempt: Attempt) -> dict[int, Any]:
        """Return the ranks' latest heartbeats (on Relay's clock), asking the agents now."""
        return self.status(attempt).heartbeats

    def stop(self, attempt: Attempt, grace_seconds: float = STOP_GRACE_SECONDS) -> list[str]:
        """Stop every process of the attempt; return the PIDs that survived (should be none)."""
        root = attempt.runs_in
        cut_off = {n.strip() for n in os.environ.get(ENV_PARTITIONED, "").split(",") if n.strip()}
        handle = self._handle(attempt)
        if cut_off & set(handle):
            log.warning("Test hook %s: cannot reach %s to stop it (a simulated partition)",
                        ENV_PARTITIONED, sorted(cut_off & set(handle)))
        reachable = [n for n in handle if n not in cut_off]
        if reachable:
            self._mark_stop(root)
        took = self.channel(attempt).ask_to_stop(reachable, STOP_ASK_TIMEOUT_SECONDS)
        groups = {handle[n]["pgid"]: handle[n]["started"] for n in reachable}
        ours = {g: s for g, s in groups.items() if self._ours(g, s)}
        live = [g for g in ours if group_members(g)]
        if not live:
            return []
        log.info("Stopping process groups %s of %s", live, root)
        self._kill_deaf_agents({n: handle[n] for n in reachable if n not in took}, live)
        for sig in (signal.SIGTERM, signal.SIGCONT):  # SIGCONT: a stopped rank must see SIGTERM
            for pgid in live:
                pids.signal_group(pgid, ours[pgid], sig)
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and any(group_members(g) for g in live):
            time.sleep(STOP_POLL_SECONDS)
        for pgid in live:
            if group_members(pgid):
                log.warning("Process group %d ignored SIGTERM; sending SIGKILL", pgid)
                pids.signal_group(pgid, ours[pgid], signal.SIGKILL)
        deadline = time.monotonic() + grace_seconds
        survivors: list[int] = []
        while time.monotonic() < deadline:
            survivors = [p for g in live for p in group_members(g)]
            if not survivors:
                break
            time.sleep(STOP_POLL_SECONDS)
        if survivors:
            log.error("Processes %s survived SIGKILL in %s", survivors, root)
        return [f"pid {p}" for p in survivors]

    @staticmethod
    def _mark_stop(root: Path) -> None:
        """Mark the stop in the attempt folder before asking and signalling: an agent whose
        ask is late or lost (frozen, loaded) still takes its SIGTERM as Relay's stop, not as
        a preemption notice. A mark that cannot be written stops nothing from stopping."""
        try:
            write_atomically(root / STOP_FILE, json.dumps({"at": time.time()}))
        except OSError as exc:
            log.warning("Cannot mark the stop of %s (%s): an agent that misses the channel's "
                        "ask reads its SIGTERM as a preemption notice", root, exc)

    @staticmethod
    def _kill_deaf_agents(deaf: dict[str, dict[str, int | None]], live: list[int]) -> None:
        """SIGKILL the agent of each node on the channel that did not answer the stop (a
        frozen node: ``deaf``, node -> its handle); its ranks get the SIGTERM that follows.

        A frozen agent has nothing to save: its ranks are stopped by the group's SIGTERM,
        and waiting for its own orderly exit (before the stop mark, its SIGTERM read as a
        preemption notice and waited the whole ``grace_seconds``) cost 5.2 s of a frozen
        node's time to resume in `relay bench resume`."""
        for node, ids in deaf.items():
            if ids["port"] is not None and ids["pgid"] in live and ids["pid"] == ids["pgid"]:
                log.warning("The agent of %s did not answer the stop over the channel: "
                            "SIGKILL (a SIGTERM would read as a preemption notice)", node)
                pids.signal_process(int(ids["pid"]), ids["started"], signal.SIGKILL)

    @staticmethod
    def _ours(pgid: int, started: int | None) -> bool:
        """Return whether a recorded group is still ours; log (once per stop) if it is not."""
        if pids.group_is_ours(pgid, started):
            return True
        log.warning("Leaving process group %d alone: its leader PID now belongs to another "
                    "process (recorded start time %s, found %s)", pgid, started,
                    pids.start_time(pgid))
        return False

    def has_processes(self, attempt: Attempt) -> bool:
        """Return whether any recorded process group of the attempt still has a member."""
        groups = [ids["pgid"] for ids in self._handle(attempt).values()]
        return any(group_members(g) for g in groups if g is not None)

    def stop_all(self, segment_dir: Path) -> list[str]:
        """Stop every earlier attempt of a segment (e.g. left behind by a killed task)."""
        survivors: list[str] = []
        if segment_dir.is_dir():
            for attempt in sorted(segment_dir.iterdir()):
                if (attempt / HANDLE_FILE).exists():
                    survivors += self.stop(Attempt(attempt))
        return survivors

    # -- chaos: only local process groups can be frozen and killed from here --------

    def running_attempts(self, base: Path) -> list[Attempt]:
        """Return the running attempts under ``base``, newest first."""
        handles = sorted(base.rglob(HANDLE_FILE), key=lambda p: p.stat().st_mtime, reverse=True)
        found = [Attempt(h.parent) for h in handles]
        return [a for a in found if self.status(a).state is AttemptState.RUNNING]
