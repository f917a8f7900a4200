"""Run a segment attempt as local processes: one node agent per simulated node.

Each agent starts in its own session, so its process group (agent + ranks)
outlives the Airflow task that launched it while the task defers, and can be
stopped as a whole by PGID. Everything needed to find the workload again is in
the attempt folder: ``handle.json`` (PIDs, PGIDs and the agents' start times)
and ``status/<node>.json`` (written by the agents). Every signal goes through
:mod:`relay_train.pids`, so a PID reused by another process is never touched.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.launchers.base import LaunchState, LaunchStatus, NodeStatus, overall_state
from relay_train import pids
from relay_train.heartbeat import read_heartbeats, write_atomically
from relay_train.launch import LAUNCH_FILE, LaunchConfig
from relay_train.standby import (
    STANDBY_TTL_SECONDS,
    claimed_file,
    hand_over,
    ready_file,
    standby_file,
)

if TYPE_CHECKING:
    from relay.nodes import Quarantine

__all__ = [
    "LaunchState", "LaunchStatus", "LocalLauncher", "NodeStatus", "NotOursError", "free_port",
]

log = logging.getLogger(__name__)

HANDLE_FILE = "handle.json"
STOP_GRACE_SECONDS = 5.0
STANDBY_DIR = "standby"  # in a segment's folder: agents preloading for its next attempt
STANDBY_WAIT_SECONDS = 10.0  # a standby still preloading is worth waiting for this long


class NotOursError(LookupError):
    """A recorded process is gone and its PID (or PGID) may now belong to another process."""


def free_port() -> int:
    """Return a free TCP port on loopback for a fresh rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def agent_handle(pid: int) -> dict[str, int | None]:
    """Return the handle of an agent that leads its own process group: PID, PGID, start time."""
    return {"pid": pid, "pgid": pid, "started": pids.start_time(pid)}


def group_members(pgid: int) -> list[int]:
    """Return the live (non-zombie) PIDs in process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _standby(directory: Path, node: str) -> tuple[int, int | None] | None:
    """Return the node's standby agent as (PID, start time), if one was recorded."""
    try:
        record = json.loads(standby_file(directory, node).read_text())
        started = record.get("started")
        return int(record["pid"]), None if started is None else int(started)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _standby_pid(directory: Path, node: str) -> int | None:
    """Return the PID of the node's standby agent if it is still the one recorded and alive."""
    found = _standby(directory, node)
    if found is None or not pids.is_running(*found):
        return None
    return found[0]


class LocalLauncher:
    """Start, watch and stop segment attempts as local process groups."""

    name = "local"

    def config(self) -> dict[str, Any]:
        """Return the factory's description of this launcher."""
        return {"kind": self.name}

    def slots(self, nodes: list[str]) -> list[str]:
        """Return ``nodes``: a simulated node is its own slot."""
        return list(nodes)

    def host_of(self, root: Path, node: str) -> str:
        """Return ``node``: a simulated node is its own host."""
        return node

    def enforce_quarantines(self, held: dict[str, Quarantine]) -> None:
        """Do nothing: the node pool's selection already keeps quarantined nodes out."""

    def launch(self, cfg: LaunchConfig, standby_dir: Path | None = None) -> Path:
        """Write the launch file, start one agent per node; return the attempt folder.

        A node with a standby agent in ``standby_dir`` gets it (already preloaded);
        the standbys nobody claimed are stopped afterwards.
        """
        root = cfg.root
        for sub in (root, cfg.log_dir, cfg.status_dir, cfg.heartbeat_dir):
            sub.mkdir(parents=True, exist_ok=True)
        launch_file = root / LAUNCH_FILE
        cfg.write(launch_file)
        handle: dict[str, dict[str, int | None]] = {}
        for node in cfg.nodes:
            pid = self._claim(standby_dir, node, launch_file) if standby_dir else None
            if pid is not None:
                handle[node] = {**agent_handle(pid), "standby": True}
                log.info("Handed %s to its standby agent (pid %d, preloaded)", node, pid)
                continue
            with (cfg.log_dir / f"agent-{node}.log").open("ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "relay_train.agent", "--launch", str(launch_file),
                     "--node", node],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=root,
                    start_new_session=True,
                )
            handle[node] = agent_handle(proc.pid)
            log.info("Started agent for %s as pid %d", node, proc.pid)
        (root / HANDLE_FILE).write_text(json.dumps({"nodes": handle, "started_at": time.time()}))
        if standby_dir is not None:
            self.release_standbys(standby_dir)
        return root

    def prestart(
        self, directory: Path, nodes: list[str], ttl_seconds: float = STANDBY_TTL_SECONDS
    ) -> None:
        """Start a standby agent for each node, to preload while a retry is prepared."""
        directory.mkdir(parents=True, exist_ok=True)
        for node in nodes:
            if _standby_pid(directory, node) is not None:
                continue
            with (directory / f"{node}.log").open("ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "relay_train.agent", "--standby", str(directory),
                     "--node", node, "--ttl", str(ttl_seconds)],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    cwd=directory, start_new_session=True,
                )
            write_atomically(standby_file(directory, node), json.dumps(
                {"pid": proc.pid, "started": pids.start_time(proc.pid),
                 "started_at": time.time()}))
            log.info("Started a standby agent for %s as pid %d", node, proc.pid)

    @staticmethod
    def _claim(
        directory: Path, node: str, launch_file: Path, wait_seconds: float = STANDBY_WAIT_SECONDS
    ) -> int | None:
        """Take the node's standby agent, waiting while it preloads; return its PID."""
        deadline = time.monotonic() + wait_seconds
        while (pid := _standby_pid(directory, node)) is not None:
            try:
                os.rename(ready_file(directory, node), claimed_file(directory, node))
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)
                continue
            hand_over(directory, node, launch_file)
            standby_file(directory, node).unlink(missing_ok=True)
            return pid
        return None

    @staticmethod
    def release_standbys(directory: Path) -> None:
        """Stop every standby agent in ``directory`` that nobody claimed."""
        for record in directory.glob("*.standby"):
            node = record.name.removesuffix(".standby")
            found = _standby(directory, node)
            if found is not None and group_members(found[0]):
                log.info("Stopping the unclaimed standby agent of %s (pid %d)", node, found[0])
                pids.signal_group(found[0], found[1], signal.SIGTERM)
            for f in (record, ready_file(directory, node), claimed_file(directory, node)):
                f.unlink(missing_ok=True)

    @staticmethod
    def _handle(root: Path) -> dict[str, dict[str, int | None]]:
        try:
            nodes = json.loads((root / HANDLE_FILE).read_text())["nodes"]
            return {
                str(n): {"pid": int(ids["pid"]), "pgid": int(ids["pgid"]),
                         "started": None if ids.get("started") is None else int(ids["started"])}
                for n, ids in nodes.items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    @staticmethod
    def started_at(root: Path) -> float:
        """Return when the attempt was launched (epoch seconds)."""
        return float(json.loads((root / HANDLE_FILE).read_text())["started_at"])

    def status(self, root: Path) -> LaunchStatus:
        """Read agents' status files and check their PIDs; never blocks."""
        nodes: dict[str, NodeStatus] = {}
        for node, ids in self._handle(root).items():
            try:
                record = json.loads((root / "status" / f"{node}.json").read_text())
            except (OSError, ValueError):
                record = None
            alive = pids.is_running(ids["pid"], ids["started"])
            if record is None:
                state = "starting" if alive else "failed"
                detail = "" if alive else "agent exited before reporting any status"
                nodes[node] = NodeStatus(node, state, detail=detail)
                continue
            codes = {int(r): c for r, c in record.get("exit_codes", {}).items()}
            state = record.get("state", "running")
            detail = ""
            if state in ("starting", "running") and not alive:
                state, detail = "failed", "agent died without a final status (killed?)"
            errors = {int(r): str(t) for r, t in (record.get("errors") or {}).items()}
            nodes[node] = NodeStatus(node, state, codes, detail, record.get("wall_clock"),
                                     errors=errors)
        return LaunchStatus(overall_state(nodes), nodes)

    def stop(self, root: Path, grace_seconds: float = STOP_GRACE_SECONDS) -> list[str]:
        """Stop every process of the attempt; return the PIDs that survived (should be none)."""
        groups = {ids["pgid"]: ids["started"] for ids in self._handle(root).values()}
        ours = {g: s for g, s in groups.items() if self._ours(g, s)}
        live = [g for g in ours if group_members(g)]
        if not live:
            return []
        log.info("Stopping process groups %s of %s", live, root)
        for sig in (signal.SIGTERM, signal.SIGCONT):  # SIGCONT: a stopped rank must see SIGTERM
            for pgid in live:
                pids.signal_group(pgid, ours[pgid], sig)
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and any(group_members(g) for g in live):
            time.sleep(0.1)
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
            time.sleep(0.05)
        if survivors:
            log.error("Processes %s survived SIGKILL in %s", survivors, root)
        return [f"pid {p}" for p in survivors]

    @staticmethod
    def _ours(pgid: int, started: int | None) -> bool:
        """Return whether a recorded group is still ours; log (once per stop) if it is not."""
        if pids.group_is_ours(pgid, started):
            return True
        log.warning("Leaving process group %d alone: its leader PID now belongs to another "
                    "process (recorded start time %s, found %s)", pgid, started,
                    pids.start_time(pgid))
        return False

    def stop_all(self, segment_dir: Path) -> list[str]:
        """Stop every earlier attempt of a segment (e.g. left behind by a killed task)."""
        survivors: list[str] = []
        if segment_dir.is_dir():
            for attempt in sorted(segment_dir.iterdir()):
                if (attempt / HANDLE_FILE).exists():
                    survivors += self.stop(attempt)
        return survivors

    # -- chaos: only local process groups can be frozen and killed from here --------

    def running_attempts(self, base: Path) -> list[Path]:
        """Return the running attempts under ``base``, newest first."""
        handles = sorted(base.rglob(HANDLE_FILE), key=lambda p: p.stat().st_mtime, reverse=True)
        return [h.parent for h in handles if self.status(h.parent).state is LaunchState.RUNNING]

    def signal_node(self, root: Path, node: str, sig: signal.Signals) -> int:
        """Send ``sig`` to every process of ``node`` (its agent and its ranks); return the PGID.

        Raise KeyError for a node the attempt does not have, and :class:`NotOursError`
        when the group's recorded leader PID now belongs to another process.
        """
        handle = self._handle(root)
        if node not in handle:
            raise KeyError(f"node {node!r}: expected one of {sorted(handle)} in {root}")
        pgid = handle[node]["pgid"]
        if not pids.signal_group(pgid, handle[node]["started"], sig):
            raise NotOursError(f"node {node!r} (process group {pgid})")
        return pgid

    @staticmethod
    def _rank(root: Path, rank: int) -> tuple[int, int | None] | None:
        """Return a rank's PID and start time from its heartbeat (None before its first one)."""
        beat = read_heartbeats(root / "heartbeats").get(rank)
        return None if beat is None else (beat.pid, beat.pid_started)

    @classmethod
    def rank_pid(cls, root: Path, rank: int) -> int | None:
        """Return the PID a rank reported in its heartbeat (None before its first one).

        Raise :class:`NotOursError` if that PID is no longer the rank's process.
        """
        found = cls._rank(root, rank)
        if found is None:
            return None
        if not pids.is_same_process(*found):
            raise NotOursError(f"rank {rank} (pid {found[0]})")
        return found[0]

    @classmethod
    def _rank_or_raise(cls, root: Path, rank: int) -> tuple[int, int | None]:
        found = cls._rank(root, rank)
        if found is None:
            raise KeyError(f"rank {rank}: no heartbeat in {root / 'heartbeats'} yet")
        return found

    @classmethod
    def signal_rank(cls, root: Path, rank: int, sig: signal.Signals) -> int:
        """Send ``sig`` to one rank (by the PID in its heartbeat, if still its); return the PID."""
        pid, started = cls._rank_or_raise(root, rank)
        if not pids.signal_process(pid, started, sig):
            raise NotOursError(f"rank {rank} (pid {pid})")
        return pid

    @classmethod
    def throttle_rank(cls, root: Path, rank: int, running: float, period: float,
                      seconds: float) -> bool:
        """Freeze a rank for ``1 - running`` of every ``period`` for ``seconds``.

        Return False if the rank ended meanwhile (its PID is then never signalled again).
        """
        pid, started = cls._rank_or_raise(root, rank)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                if not pids.signal_process(pid, started, signal.SIGSTOP):
                    return False
                time.sleep(period * (1 - running))
                pids.signal_process(pid, started, signal.SIGCONT)
                time.sleep(period * running)
        finally:
            pids.signal_process(pid, started, signal.SIGCONT)
        return True
