"""A node agent's standby copy, forked from an agent (or a resident): what Relay asks
for, and how the copy leaves the attempt it was forked from. It then runs as a standby
(``relay_train.agent.node.run_standby``: preloaded, waiting to be claimed, taking over).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import stat
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path


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


def leave_attempt(node: str, directory: Path) -> None:
    """In a child of ``fork_detached`` (it left the attempt's process group, so stopping
    the attempt does not stop it): drop the attempt before running as a standby.

    The child closes every socket it inherited (the attempt's channel, a request being
    answered), forgets the attempt's ranks (not its children) and logs, as ``node``'s
    agent, to ``directory`` (the standby folder).
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for handler in logging.getLogger().handlers:  # a resident's child names the agent
        handler.setFormatter(logging.Formatter(agent_log_format(node)))
    _close_inherited_sockets()
    multiprocessing.process._children.clear()  # type: ignore[attr-defined]  # the parent's ranks
    directory.mkdir(parents=True, exist_ok=True)
    redirect_output(directory / f"{node}.log")


def agent_log_format(node: str) -> str:
    """Return the logging format of ``node``'s agent (and of its standbys)."""
    return f"%(asctime)s agent {node} %(levelname)s: %(message)s"


def _close_inherited_sockets() -> None:
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:
            continue  # the listing's own descriptor, already closed


def redirect_output(path: Path) -> None:
    """Send this process's stdout and stderr to ``path`` (appended)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
