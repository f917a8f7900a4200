"""Who acts on an attempt's fault, decided by its node agents, not by a shared disk.

Two kinds of actor may act on a detected fault: ``execute_complete`` and the
attempt's warden (:mod:`relay.recover.warden`), and with Celery or Kubernetes
executors they may run on different machines (Airflow may even run a watcher,
and so start a warden, twice). Each asks every agent of the attempt to grant it
the claim (``POST /v1/claim``); an agent grants the first claimer and names it
to the others. An actor takes the attempt when

- a strict majority of the attempt's agents grant it (a frozen node cannot keep
  a majority of the rest from deciding), or
- no agent that answers names another holder: then no one else can be using
  the agents (a rescue, a drain, stacks), and what is left, the stop, is safe
  to do twice (a frozen node of a two-node attempt, or agents already stopped).

Otherwise another actor holds it: the warden leaves, ``execute_complete``
waits for what the warden saved. A network split that shows each actor a
disjoint set of agents could let both act; the cost is a rescue lost (the
retry resumes from the latest checkpoint), never a second decision.
"""

from __future__ import annotations

import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from relay.launchers import Launcher
from relay.launchers.agent_client import MAX_PARALLEL
from relay.recover.warden import CLAIM_SECONDS
from relay_train.protocol.routes import BY, GRANTED, HOLDER, Route

CLAIM_TIMEOUT_SECONDS = CLAIM_SECONDS  # every agent is asked at once: a silent one costs it once

log = logging.getLogger(__name__)


def claimer(role: str) -> str:
    """Return a name for this actor that no other process on any machine has."""
    return f"{role} pid {os.getpid()} on {socket.gethostname()}"


@dataclass
class ClaimOutcome:
    """What the agents said to one claimer."""

    by: str
    nodes: list[str]
    granted: list[str] = field(default_factory=list)
    held_by: dict[str, str] = field(default_factory=dict)  # node -> the holder it named
    silent: list[str] = field(default_factory=list)

    @property
    def won(self) -> bool:
        """Return whether this claimer takes the attempt (see the module docstring)."""
        return 2 * len(self.granted) > len(self.nodes) or not self.held_by

    @property
    def holder(self) -> str | None:
        """Return the other actor most refusing agents named, if any."""
        named = list(self.held_by.values())
        return max(set(named), key=named.count) if named else None

    def describe(self) -> str:
        """Return e.g. ``granted by node-a, node-b; held by X at node-c; silent: node-d``."""
        parts = [f"granted by {', '.join(self.granted) or 'none'}"]
        parts += [f"held by {h} at {n}" for n, h in self.held_by.items()]
        if self.silent:
            parts.append(f"silent: {', '.join(self.silent)}")
        return "; ".join(parts)


def claim_attempt(launcher: Launcher, root: Path, by: str,
                  timeout: float = CLAIM_TIMEOUT_SECONDS) -> ClaimOutcome:
    """Ask every agent of the attempt at ``root`` to grant ``by`` the claim."""
    channel = launcher.channel(root)
    nodes = sorted(channel.addresses)
    outcome = ClaimOutcome(by, nodes)
    if not nodes:
        return outcome

    def ask(node: str) -> tuple[str, dict[str, object] | None]:
        try:
            reply = channel.call(node, Route.CLAIM, body={BY: by}, timeout=timeout)
        except LookupError:  # an agent of another attempt: it grants nothing here
            return node, None
        return node, reply if isinstance(reply, dict) else None

    with ThreadPoolExecutor(max_workers=min(len(nodes), MAX_PARALLEL)) as pool:
        for node, reply in pool.map(ask, nodes):
            if reply is None:
                outcome.silent.append(node)
            elif reply.get(GRANTED):
                outcome.granted.append(node)
            else:
                outcome.held_by[node] = str(reply.get(HOLDER))
    log.info("Claim of %s by %s: %s (%s)", root, by, "taken" if outcome.won else "not taken",
             outcome.describe())
    return outcome
