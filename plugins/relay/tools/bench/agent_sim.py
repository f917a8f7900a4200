"""Many node agents from one process, for `relay bench watcher`: the real channel, simulated ranks.

Each simulated node listens on its own loopback port and answers with the real agent
server's request handling (:class:`relay_train.agent.server.AgentServer`'s handler: the
same routes, HMAC credential, fencing and limits), driven by one selector loop here
instead of a thread per node and per request. Only ``status`` differs: its heartbeats
come from :class:`~relay.tools.bench.sim_cluster.Cluster`, a model of data-parallel
ranks on the clock, not from files (1,024 nodes x 8 ranks rewriting files every 0.5 s
cost more than the watcher under test). ``stop``, ``drain``, ``rescue`` and ``stacks``
act on each node's folder as a real agent's do.

Faults (:class:`SimFault`) are scripted by time, and may be added while it runs (one
JSON object a line on stdin, after the channel secret); their kinds are those of
:mod:`relay_train.protocol.injection` where one fits:

- ``stop_node``: the node freezes: its agent stops answering and its ranks' heartbeats
  stop (a SIGSTOP'd process group);
- ``stop_rank``: one rank goes silent; its agent still answers, with an ageing heartbeat;
- ``hang``: one rank stays in compute, every other waits in the collective; heartbeats
  stay fresh (their writer threads live on), steps stop;
- ``straggler``: one rank's compute takes ``factor`` x as long; the job steps at its pace;
- ``partition``: the node's agent is unreachable (no answer) until ``until``; its ranks
  carry on.

With ``GROUP_SIZE`` > 0 it also serves one aggregator per group of that many nodes
(:mod:`relay.launchers.agent_groups`): the real server's ``summary`` route, its answer
built by the real :func:`~relay.launchers.agent_groups.encode_summary` from what the
group's agents said at the aggregator's last round (every ``AGGREGATE_SECONDS``), so its
nodes' answers age as a real aggregator's do. ``stop_node`` on an aggregator's name
freezes that aggregator.

One process cannot keep up with the watcher's requests at a thousand nodes (it fell
behind its aggregators, which then counted as down): the bench runs one per shard
(``SHARD SHARDS STARTED_AT``), each serving every ``SHARDS``-th group of nodes (with its
aggregator) from the same model of the job, on the same clock (``STARTED_AT``); every
fault is written to every shard.

Run: ``python -m relay.tools.bench.agent_sim ROOT NODES RANKS_PER_NODE ATTEMPT_ID
[GROUP_SIZE [SHARD SHARDS STARTED_AT]]`` with the channel secret as stdin's first line; it
writes ``ports-SHARD.json`` (:func:`ports_file`: node -> port, aggregators: name -> port
and nodes, and its ``started_at``) in ROOT once every node it serves listens.
"""

from __future__ import annotations

import json
import logging
import math
import selectors
import sys
import threading
import time
from pathlib import Path
from socketserver import StreamRequestHandler
from typing import Any

from relay.launchers.agent_groups import AGGREGATE_SECONDS, encode_summary, groups_of
from relay.tools.bench.sim_cluster import Cluster, SimFault
from relay_train.agent.server import AgentServer
from relay_train.protocol import routes as wire
from relay_train.protocol.heartbeat import write_atomically
from relay_train.protocol.routes import EXIT_CODES, HEARTBEATS, STATE, NodeState

log = logging.getLogger(__name__)

SHARD_NODES = 32  # nodes a simulator process serves (the bench's shards) without aggregators


def ports_file(shard: int) -> str:
    """Return the name of the file shard ``shard`` writes its ports in."""
    return f"ports-{shard}.json"


def shards_for(nodes: int, group_size: int) -> int:
    """Return how many simulator processes serve ``nodes`` nodes: one per aggregator's group
    (or per :data:`SHARD_NODES` nodes without aggregators)."""
    per = group_size if group_size > 0 and groups_of([""] * nodes, group_size) else SHARD_NODES
    return max(1, math.ceil(nodes / per))


class SimAgent:
    """One simulated node agent: what the real server asks of its agent (``Served``)."""

    def __init__(self, cluster: Cluster, node: str, attempt_id: str, root: Path) -> None:
        self.cluster = cluster
        self.node = node
        self.attempt_id = attempt_id
        self.root = root / "nodes" / node  # requests and answers (made when first asked)
        self.ranks = cluster.ranks_of(node)
        self.stopping = False

    def status_record(self) -> dict[str, Any]:
        """Return the node's state and its ranks' exit codes (none: running)."""
        state = NodeState.STOPPING if self.stopping else NodeState.RUNNING
        return {STATE: state, EXIT_CODES: {str(r): None for r in self.ranks}}

    def request_stop(self, reason: str) -> None:
        """Say the node is stopping (its simulated ranks keep their last word)."""
        log.info("agent_sim: %s asked to stop: %s", self.node, reason)
        self.stopping = True

    def request_standby(self, directory: Path, ttl: float, linger: float) -> int | None:
        """Fork no standby: a simulated node has none."""
        return None


class SimAggregator:
    """One simulated aggregator: what its group's agents said at its last round."""

    def __init__(self, cluster: Cluster, name: str, agents: list[SimAgent], attempt_id: str,
                 offset: float) -> None:
        self.cluster = cluster
        self.node = name
        self.attempt_id = attempt_id
        self.root = Path()
        self.ranks: list[int] = []
        self.agents = agents
        self.offset = offset  # aggregators ask out of step with one another
        self.round = float("-inf")
        self.heard: dict[str, tuple[float, dict[str, Any]]] = {}

    def status_record(self) -> dict[str, Any]:
        """Say it runs."""
        return {STATE: NodeState.RUNNING}

    def summary_record(self, now: float | None = None) -> dict[str, Any]:
        """Return the group's summary as the aggregator's last round left it."""
        now = time.time() if now is None else now
        at = self.offset + math.floor((now - self.offset) / AGGREGATE_SECONDS) * AGGREGATE_SECONDS
        if at > self.round:
            self.round = at
            for agent in self.agents:
                if self.cluster.answers(agent.node, at):
                    self.heard[agent.node] = (at, {**agent.status_record(),
                                                   HEARTBEATS: self.cluster.report(agent.node, at)})
        return encode_summary(self.heard, now)

    def request_stop(self, reason: str) -> None:
        """Nothing to stop."""

    def request_standby(self, directory: Path, ttl: float, linger: float) -> int | None:
        """Fork no standby."""
        return None


class _NoDeadline:
    """One request at a time, on loopback: no timer thread per request."""

    def cancel(self) -> None:
        """Nothing to cancel."""


def _sim_handler(base: type[StreamRequestHandler], cluster: Cluster) -> type:
    """Return the real server's request handler with ``status`` read from ``cluster``."""

    class SimHandler(base):  # type: ignore[valid-type, misc]
        def setup(self) -> None:
            StreamRequestHandler.setup(self)  # the real handler's, less its Deadline timer
            self.deadline = _NoDeadline()

        def _status(self, _query: dict[str, Any]) -> dict[str, Any]:
            if not isinstance(self.agent, SimAgent):
                return self.agent.status_record()
            now = time.time()
            return {**self.agent.status_record(),
                    wire.HEARTBEATS: cluster.report(self.agent.node, now), wire.CROSSED: []}

    return SimHandler


class Simulator:
    """Serve the simulated nodes' channels of one shard (every ``shards``-th group of
    nodes, with its aggregator) from one thread."""

    def __init__(self, cluster: Cluster, attempt_id: str, root: Path, secret: str,
                 group_size: int = 0, shard: int = 0, shards: int = 1) -> None:
        self.cluster = cluster
        self.servers: dict[str, Any] = {}  # node -> its (never started) AgentServer's httpd
        names = [cluster.node_name(n) for n in range(cluster.nodes)]
        cut = groups_of(names, group_size) if group_size > 0 else []
        blocks = cut or [names[i:i + SHARD_NODES] for i in range(0, len(names), SHARD_NODES)]
        agents = {}
        for node in (n for b, block in enumerate(blocks) if b % shards == shard for n in block):
            agents[node] = SimAgent(cluster, node, attempt_id, root)
            self.servers[node] = self._serve(agents[node], secret)
        self.groups: dict[str, list[str]] = {}  # aggregator -> its nodes
        for g, nodes in enumerate(cut):
            if g % shards != shard:
                continue
            name = f"aggregator-{g}"
            self.groups[name] = nodes
            offset = cluster.started_at + AGGREGATE_SECONDS * g / max(len(cut), 1)
            self.servers[name] = self._serve(SimAggregator(
                cluster, name, [agents[n] for n in nodes], attempt_id, offset), secret)
        self.selector = selectors.DefaultSelector()
        self.listening: set[str] = set()
        self.stop = threading.Event()

    def _serve(self, agent: SimAgent | SimAggregator, secret: str) -> Any:  # noqa: ANN401
        """Return a (never started) real AgentServer's httpd for ``agent``."""
        httpd = AgentServer(agent, "127.0.0.1", 0, secret=secret).httpd
        httpd.RequestHandlerClass = _sim_handler(httpd.RequestHandlerClass, self.cluster)
        return httpd

    def ports(self) -> dict[str, int]:
        """Return each node's port."""
        return {node: int(httpd.server_address[1]) for node, httpd in self.servers.items()
                if node not in self.groups}

    def aggregators(self) -> dict[str, dict[str, Any]]:
        """Return each aggregator's port and nodes."""
        return {name: {"port": int(self.servers[name].server_address[1]), "nodes": nodes}
                for name, nodes in self.groups.items()}

    def _listen_to_answering(self, now: float) -> None:
        """Serve the nodes that answer now; leave the others' connections unanswered."""
        for node, httpd in self.servers.items():
            answers = self.cluster.answers(node, now)
            if answers and node not in self.listening:
                self.selector.register(httpd.socket, selectors.EVENT_READ, httpd)
                self.listening.add(node)
            elif not answers and node in self.listening:
                self.selector.unregister(httpd.socket)
                self.listening.discard(node)

    def serve(self) -> None:
        """Answer requests until :attr:`stop` is set (one at a time: each is small)."""
        next_check = 0.0
        while not self.stop.is_set():
            now = time.time()
            if now >= next_check:
                self._listen_to_answering(now)
                next_check = now + 0.05
            for key, _ in self.selector.select(0.05):
                httpd = key.data
                try:
                    request, address = httpd.get_request()
                except OSError:
                    continue
                try:
                    httpd.finish_request(request, address)
                except Exception:  # noqa: BLE001 - one bad request is not the simulator's end
                    log.exception("agent_sim: a request failed")
                finally:
                    httpd.shutdown_request(request)

    def close(self) -> None:
        """Close every listening socket."""
        self.stop.set()
        for httpd in self.servers.values():
            httpd.server_close()


def _read_faults(cluster: Cluster) -> None:
    """Add each fault read from stdin (a JSON object a line) to the script, as it comes."""
    for line in sys.stdin:
        if line.strip():
            cluster.faults.append(SimFault.from_dict(json.loads(line)))


def main(argv: list[str]) -> int:
    """Serve ``NODES`` simulated agents until killed."""
    root, nodes, per_node, attempt_id = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    group_size = int(argv[4]) if len(argv) > 4 else 0
    shard, shards = (int(argv[5]), int(argv[6])) if len(argv) > 6 else (0, 1)
    started_at = float(argv[7]) if len(argv) > 7 else time.time()
    secret = sys.stdin.readline().strip()  # the channel secret: not on the command line
    cluster = Cluster(nodes, per_node, started_at)
    sim = Simulator(cluster, attempt_id, root, secret, group_size, shard, shards)
    write_atomically(root / ports_file(shard), json.dumps({"ports": sim.ports(),
                                                    "aggregators": sim.aggregators(),
                                                    "started_at": cluster.started_at}))
    threading.Thread(target=_read_faults, args=(cluster,), daemon=True).start()
    try:
        sim.serve()
    finally:
        sim.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
