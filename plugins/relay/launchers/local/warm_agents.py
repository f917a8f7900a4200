"""The local launcher's standby and resident agents: their records, how a launch takes one,
and their release.

A standby agent (:mod:`relay_train.agent.standby`) or a resident agent
(:mod:`relay_train.agent.resident`) is recorded in its folder as ``<node>.standby``:
its PID and start time, so that only that process is ever taken or signalled.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from relay.core.proctree import group_members
from relay_train.agent.resident import RESIDENT_DIR, ask_standby
from relay_train.agent.standby import hand_over, ready_file, standby_file, taken_file
from relay_train.protocol import pids
from relay_train.protocol.heartbeat import write_atomically

log = logging.getLogger(__name__)

STANDBY_DIR = "standby"  # in a segment's folder: agents preloading for its next attempt
STANDBY_WAIT_SECONDS = 10.0  # a standby still preloading is worth waiting for this long
# An agent whose ranks ended keeps answering (its final state) until stopped, at most this long.
LINGER_SECONDS = 600.0


def recorded(directory: Path, node: str) -> tuple[int, int | None] | None:
    """Return the node's standby agent as (PID, start time), if one was recorded."""
    try:
        found = json.loads(standby_file(directory, node).read_text())
        started = found.get("started")
        return int(found["pid"]), None if started is None else int(started)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def recorded_pid(directory: Path, node: str) -> int | None:
    """Return the PID of the node's standby agent if it is still the one recorded and alive."""
    found = recorded(directory, node)
    if found is None or not pids.is_running(*found):
        return None
    return found[0]


def record(directory: Path, node: str, pid: int) -> None:
    """Record ``pid`` as ``node``'s standby (or resident) agent in ``directory``."""
    write_atomically(standby_file(directory, node), json.dumps(
        {"pid": pid, "started": pids.start_time(pid), "started_at": time.time()}))


def start_recorded(module_args: list[str], directory: Path, node: str,
                   env: dict[str, str] | None = None) -> int:
    """Start ``python -m MODULE ARGS`` in a session of its own, logging to
    ``directory/<node>.log``; record it; return its PID."""
    with (directory / f"{node}.log").open("ab") as out:
        pid = subprocess.Popen(
            [sys.executable, "-m", *module_args], stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=directory, start_new_session=True, env=env,
        ).pid
    record(directory, node, pid)
    return pid


def recorded_nodes(directory: Path) -> list[str]:
    """Return the nodes with a standby (or resident) agent recorded in ``directory``."""
    return sorted(path.name.removesuffix(".standby") for path in directory.glob("*.standby"))


def live_resident(directory: Path, prefer: str | None = None) -> str | None:
    """Return the node of a live resident agent recorded in ``directory`` (a DAG run's
    resident folder), ``prefer``'s if it has one; None if none is alive."""
    nodes = recorded_nodes(directory)
    for node in ([prefer] if prefer in nodes else []) + nodes:
        if recorded_pid(directory, node) is not None:
            return node
    return None


def from_resident(directory: Path, node: str, ttl_seconds: float) -> int | None:
    """Have the DAG run's resident agent fork a standby for ``node`` into ``directory`` (a
    segment's standby folder, ``<run>/<segment>/standby``); return its PID, None without one.

    The local launcher's nodes share this host: the run's resident serves every node."""
    residents = directory.parent.parent / RESIDENT_DIR
    host = live_resident(residents, prefer=node)
    if host is None:
        return None
    return ask_standby(residents, host, directory, ttl_seconds, LINGER_SECONDS,
                       preloading_wait_seconds=STANDBY_WAIT_SECONDS, for_node=node)


def take_standby(
    directory: Path, node: str, launch_file: Path, wait_seconds: float = STANDBY_WAIT_SECONDS
) -> int | None:
    """Take the node's standby agent, waiting while it preloads; return its PID."""
    deadline = time.monotonic() + wait_seconds
    while (pid := recorded_pid(directory, node)) is not None:
        try:
            os.rename(ready_file(directory, node), taken_file(directory, node))
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
            continue
        hand_over(directory, node, launch_file)
        standby_file(directory, node).unlink(missing_ok=True)
        return pid
    return None


def release(directory: Path) -> None:
    """Stop every standby (or resident) agent recorded in ``directory`` and not taken."""
    for node in recorded_nodes(directory):
        found = recorded(directory, node)
        if found is not None and group_members(found[0]):
            log.info("Stopping the untaken standby agent of %s (pid %d)", node, found[0])
            pids.signal_group(found[0], found[1], signal.SIGTERM)
        for f in (standby_file(directory, node), ready_file(directory, node),
                  taken_file(directory, node)):
            f.unlink(missing_ok=True)


def release_run(run_dir: Path) -> None:
    """The DAG run is over: stop its resident agents (:meth:`LocalLauncher.reside`) and
    every standby none of its segments took (a spare warmed at a sign of a fault that
    a boundary overtook waits out its ttl otherwise)."""
    for directory in (run_dir / RESIDENT_DIR, *run_dir.glob(f"segment-*/{STANDBY_DIR}")):
        if directory.is_dir():
            release(directory)
