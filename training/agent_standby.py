"""A node agent's standby life: forked from an agent (or a resident) or started on its
own, preloaded, waiting to be claimed, then taking over as the node's agent.

The handshake with the launcher is :mod:`relay_train.standby`'s; this is the agent's side.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from relay_train.launch import BUILTIN_ENTRYPOINT, Entrypoint, LaunchConfig
from relay_train.preload import preload_worker
from relay_train.standby import announce_ready, wait_for_launch

log = logging.getLogger("relay_train.agent")  # a standby is a node agent to be: same log


@dataclass
class StandbyAsk:
    """Relay's request for a standby forked from this agent (``NodeAgent.request_standby``)."""

    directory: Path
    ttl: float
    linger: float
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: str = "asked"  # then "forking" (main thread) or "withdrawn" (asker gave up)
    pid: int | None = None


def become_standby(node: str, ask: StandbyAsk) -> int:
    """In a child of ``fork_detached`` (it left the attempt's process group, so stopping
    the attempt does not stop it): drop the attempt, then run as a standby.

    The child closes every socket it inherited (the attempt's channel, a request being
    answered) and forgets the attempt's ranks (not its children).
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _close_inherited_sockets()
    multiprocessing.process._children.clear()  # type: ignore[attr-defined]  # the parent's ranks
    ask.directory.mkdir(parents=True, exist_ok=True)
    _redirect_output(ask.directory / f"{node}.log")
    return run_standby(ask.directory, node, ask.ttl, ask.linger)


def _close_inherited_sockets() -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:
            continue  # the listing's own descriptor, already closed


def _redirect_output(path: Path) -> None:
    """Send this process's stdout and stderr to ``path`` (appended)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run_standby(directory: Path, node: str, ttl_seconds: float,
                linger_seconds: float = 0.0) -> int:
    """Preload, wait to be claimed (see relay_train.standby), then run as the node's agent."""
    started = time.perf_counter()
    # The entrypoint is not known yet: preload the example's.
    preload_worker(Entrypoint(BUILTIN_ENTRYPOINT), publisher=True)
    preloaded = time.perf_counter() - started
    announce_ready(directory, node, preloaded)
    log.info("standby for %s: preloaded in %.2fs; waiting to be claimed", node, preloaded)
    launch = wait_for_launch(directory, node, ttl_seconds)
    if launch is None:
        log.info("standby for %s: released or unclaimed; leaving", node)
        return 0
    cfg = LaunchConfig.read(launch)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    _redirect_output(cfg.log_dir / f"agent-{node}.log")
    if node not in cfg.nodes:
        log.error("node %s: expected one of %s in %s", node, cfg.nodes, launch)
        return 2
    log.info("took over as %s's agent, preloaded in advance (%.2fs)", node, preloaded)
    from relay_train.agent import NodeAgent  # the agent's module imports this one

    return NodeAgent(cfg, launch, node, preloaded=True, linger_seconds=linger_seconds).run()
