"""Real node-agent channel servers over a folder, for unit tests of Relay's side.

:class:`ServedAttempt` starts one real :class:`relay_train.agent.server.AgentServer`
per node on loopback, serving what ranks (or a test) write in the attempt folder,
and answers ``status``/``channel`` like a launcher. Only the agent's process
supervision is left out (no ranks are forked); everything on the wire is real.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relay.core.attempt import Attempt
from relay.launchers.agent_client import AgentChannel
from relay.launchers.base import LaunchStatus, NodeStatus, overall_state
from relay_train.agent.server import AgentServer
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig, attempt_id_of
from relay_train.protocol.routes import ERRORS, EXIT_CODES, STATE, NodeState


class ServedNode:
    """What an agent reports about itself (its ranks are the test's)."""

    def __init__(self, root: Path, node: str, ranks: list[int], attempt_id: str) -> None:
        self.root = root
        self.node = node
        self.ranks = ranks
        self.attempt_id = attempt_id
        self.state = NodeState.RUNNING
        self.exit_codes: dict[int, int | None] = dict.fromkeys(ranks)
        self.errors: dict[int, str] = {}
        self.stop_reasons: list[str] = []

    def status_record(self) -> dict[str, Any]:
        return {STATE: self.state, EXIT_CODES: {str(r): c for r, c in self.exit_codes.items()},
                ERRORS: {str(r): t for r, t in self.errors.items()}}

    def request_stop(self, reason: str) -> None:
        self.stop_reasons.append(reason)


def attempt_secret(root: Path, nodes: dict[str, list[int]]) -> str:
    """Return the channel secret of the attempt at ``root``: its launch file's, as a launcher
    would have made it (one is made and written there if the file has none, and a minimal
    launch file is written where there is none: the launcher's channel reads it there)."""
    launch = root / LAUNCH_FILE
    if not launch.exists():
        root.mkdir(parents=True, exist_ok=True)
        ranks = max((len(r) for r in nodes.values()), default=1)
        LaunchConfig(job="served", seed=0, model={}, data={}, optimizer={}, start_step=0,
                     end_step=1, checkpoint_every=1, nodes=list(nodes), ranks_per_node=ranks,
                     tracking_uri="", run_id="", attempt_dir=str(root), attempt=0, segment=0,
                     channel_secret=new_secret()).write(launch)
    cfg = LaunchConfig.read(launch)
    if not cfg.channel_secret:
        cfg = dataclasses.replace(cfg, channel_secret=new_secret())
        cfg.write(launch)
    return cfg.channel_secret


class ServedAttempt:
    """A launcher's channel side over real agent servers, one per node."""

    def __init__(self, root: Path, nodes: dict[str, list[int]],
                 attempt_id: str | None = None) -> None:
        self.root = root
        served_id = attempt_id or attempt_id_of(root)
        self.nodes = {n: ServedNode(root, n, ranks, served_id) for n, ranks in nodes.items()}
        self.secret = attempt_secret(root, nodes)
        self.servers = {n: AgentServer(agent, "127.0.0.1", 0, secret=self.secret).start()
                        for n, agent in self.nodes.items()}
        self.addresses = {n: "http://{}:{}".format(*s.address) for n, s in self.servers.items()}
        self._channel: AgentChannel | None = None

    def channel(self, attempt: Attempt) -> AgentChannel:
        if self._channel is None:
            self._channel = AgentChannel(attempt_id_of(attempt.runs_in), self.addresses,
                                         self.secret)
        return self._channel

    def status(self, attempt: Attempt) -> LaunchStatus:
        channel = self.channel(attempt)
        channel.poll()
        nodes = {}
        for name in self.nodes:
            report = channel.reports.get(name)
            state = NodeState(report.record[STATE]) if report else NodeState.STARTING
            nodes[name] = NodeStatus(name, state, last_seen=report.received_at if report else None)
        return LaunchStatus(overall_state(nodes), nodes, dict(channel.beats),
                            list(channel.refused), set(channel.crossed))

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


SERVED: dict[Path, ServedAttempt] = {}  # every attempt served by serve(), until the test ends


def serve(root: Path, nodes: dict[str, list[int]]) -> ServedAttempt:
    """Return the attempt served over ``root`` (started on first use, closed after the test)."""
    if root not in SERVED:
        SERVED[root] = ServedAttempt(root, nodes)
    return SERVED[root]


@pytest.fixture(autouse=True)
def close_served_agents() -> Iterator[None]:
    """Close what :func:`serve` started (import this fixture into a test module)."""
    yield
    while SERVED:
        SERVED.popitem()[1].close()


class FrozenAgent:
    """An agent address that takes connections and never answers, as a SIGSTOPped agent's."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = "http://{}:{}".format(*self.server.getsockname())

    def was_asked(self) -> bool:
        """Return whether anybody so much as connected to it."""
        self.server.settimeout(0)
        try:
            self.server.accept()[0].close()
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        self.server.close()
