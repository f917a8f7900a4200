"""One aggregator: ask a group of node agents for their status, serve one signed summary.

It asks its group's agents every :data:`~relay.launchers.agent_groups.AGGREGATE_SECONDS`
with Relay's own :class:`~relay.launchers.agent_client.AgentChannel` (signed requests,
signed replies, fencing), and serves ``GET /v1/summary`` through the node agent's own
server (:class:`relay_train.agent.server.AgentServer`: the same credential check, replay
window, limits and TLS), with what it last heard of each node and how long ago
(:func:`~relay.launchers.agent_groups.encode_summary`). It judges nothing: a node it
cannot reach just ages in its summary, and the watcher decides.

Run: ``python -m relay.launchers.aggregator ATTEMPT_ID NAME PORT NODE=URL...`` with the
attempt's channel secret as stdin's first line; it serves on 127.0.0.1:PORT until
SIGTERM (or a signed ``stop``).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from relay.launchers.agent_client import AgentChannel
from relay.launchers.agent_groups import AGGREGATE_SECONDS, encode_summary
from relay_train.agent.server import AgentServer
from relay_train.protocol.routes import STATE, NodeState

log = logging.getLogger(__name__)


class Aggregator:
    """Ask a group's agents on a loop; what the agent server serves as ``summary``."""

    def __init__(self, attempt_id: str, name: str, addresses: dict[str, str], secret: str,
                 period: float = AGGREGATE_SECONDS) -> None:
        self.attempt_id = attempt_id
        self.node = name  # how replies name it (the channel's "node" field)
        self.root = Path()  # no node-local folder: it serves only status and summary
        self.ranks: list[int] = []
        self.channel = AgentChannel(attempt_id, addresses, secret)
        self.period = period
        self.stopped = threading.Event()

    def status_record(self) -> dict[str, Any]:
        """Say it runs (its status has no ranks of its own)."""
        return {STATE: NodeState.RUNNING}

    def summary_record(self) -> dict[str, Any]:
        """Return what each node's agent last said, with how long ago (on this clock)."""
        heard = {n: (r.received_at, r.record) for n, r in list(self.channel.reports.items())}
        return encode_summary(heard, time.time())

    def request_stop(self, reason: str) -> None:
        """End the loop (a signed ``stop``, or SIGTERM)."""
        log.info("aggregator %s: stopping: %s", self.node, reason)
        self.stopped.set()

    def request_standby(self, directory: Path, ttl: float, linger: float) -> int | None:
        """Fork no standby: an aggregator has none."""
        return None

    def run(self) -> None:
        """Ask the group's agents every period until stopped."""
        try:
            while not self.stopped.is_set():
                began = time.monotonic()
                self.channel.poll()
                self.stopped.wait(max(0.0, self.period - (time.monotonic() - began)))
        finally:
            self.channel.close()


def main(argv: list[str]) -> int:
    """Serve one group's summary until SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    attempt_id, name, port = argv[0], argv[1], int(argv[2])
    addresses = dict(pair.split("=", 1) for pair in argv[3:])
    secret = sys.stdin.readline().strip()  # not on the command line
    aggregator = Aggregator(attempt_id, name, addresses, secret)
    server = AgentServer(aggregator, "127.0.0.1", port, secret=secret).start()
    signal.signal(signal.SIGTERM, lambda *_: aggregator.request_stop("SIGTERM"))
    try:
        aggregator.run()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
