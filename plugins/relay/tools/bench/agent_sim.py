"""Many node agents from one process, for `relay bench watcher`: the real channel, simulated ranks.

Each simulated node listens on its own loopback port and answers with the real agent
server's request handling (:class:`relay_train.agent.server.AgentServer`'s handler: the
same routes, HMAC credential, fencing and limits), driven by one selector loop here
instead of a thread per node and per request. Only ``status`` differs: its heartbeats
come from :class:`Cluster`, a model of data-parallel ranks on the clock, not from files
(1,024 nodes x 8 ranks rewriting files every 0.5 s cost more than the watcher under
test). ``stop``, ``drain``, ``rescue`` and ``stacks`` act on each node's folder as a
real agent's do.

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

Run: ``python -m relay.tools.bench.agent_sim ROOT NODES RANKS_PER_NODE ATTEMPT_ID
[GROUP_SIZE]`` with the channel secret as stdin's first line; it writes ``ports.json`` (node
-> port, aggregators: name -> port and nodes, and its ``started_at``) in ROOT once every
node listens.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import selectors
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from socketserver import StreamRequestHandler
from typing import Any

from relay.launchers.agent_groups import AGGREGATE_SECONDS, encode_summary, groups_of
from relay_train.agent.server import AgentServer
from relay_train.protocol import routes as wire
from relay_train.protocol.heartbeat import Heartbeat, Phase, write_atomically
from relay_train.protocol.routes import EXIT_CODES, HEARTBEATS, STATE, NodeState

log = logging.getLogger(__name__)

SIM_KINDS = ("stop_node", "stop_rank", "hang", "straggler", "partition")
PORTS_FILE = "ports.json"
STEP_SECONDS = 0.1  # a healthy step
COMPUTE_SHARE = 0.5  # of a step; the rest is the collective
HEARTBEAT_SECONDS = 0.5  # how often a rank writes its heartbeat (the job spec's default)
JITTER = 0.03  # each rank's compute differs from the median by up to this share


@functools.cache
def _jitter(rank: int) -> float:
    """Return how much longer (or shorter) ``rank``'s compute is than the median's."""
    return 1.0 + JITTER * ((zlib.crc32(str(rank).encode()) % 201) / 100.0 - 1.0)


@dataclass(frozen=True)
class SimFault:
    """One scripted fault: ``kind`` strikes at ``at`` (epoch seconds) on ``node`` or ``rank``."""

    kind: str
    at: float
    node: str | None = None
    rank: int | None = None
    factor: float = 2.0  # straggler: compute takes this many times as long
    until: float | None = None  # partition: heals then (None: never)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SimFault:
        """Build a fault from a script line; refuse an unknown kind or a missing target."""
        kind = raw.get("kind")
        if kind not in SIM_KINDS:
            raise ValueError(f"agent_sim: expected a fault kind in {SIM_KINDS}, found {kind!r}")
        fault = cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        on_node = kind in ("stop_node", "partition")
        if (fault.node is None) if on_node else (fault.rank is None):
            raise ValueError(f"agent_sim: a {kind} fault needs a "
                             f"{'node' if on_node else 'rank'}, found {raw!r}")
        if kind == "straggler" and not fault.factor > 1.0:
            raise ValueError(f"agent_sim: expected a straggler factor above 1, found "
                             f"{fault.factor!r}")
        return fault


@dataclass
class Cluster:
    """The simulated job: which rank is where, and what each would report at any time."""

    nodes: int
    per_node: int
    started_at: float
    faults: list[SimFault] = field(default_factory=list)
    step_seconds: float = STEP_SECONDS
    heartbeat_seconds: float = HEARTBEAT_SECONDS

    def node_name(self, n: int) -> str:
        """Return the n-th node's name."""
        return f"node-{n}"

    def ranks_of(self, node: str) -> list[int]:
        """Return the global ranks of ``node``."""
        n = int(node.rsplit("-", 1)[1])
        return list(range(n * self.per_node, (n + 1) * self.per_node))

    def node_of(self, rank: int) -> str:
        """Return the node hosting ``rank``."""
        return self.node_name(rank // self.per_node)

    def _struck(self, kind: str, now: float) -> list[SimFault]:
        return [f for f in self.faults if f.kind == kind and f.at <= now]

    def answers(self, node: str, now: float) -> bool:
        """Return whether ``node``'s agent answers at ``now`` (not frozen, not cut off)."""
        for fault in self.faults:
            if fault.node != node or fault.at > now:
                continue
            if fault.kind == "stop_node":
                return False
            if fault.kind == "partition" and (fault.until is None or now < fault.until):
                return False
        return True

    def _steps(self, rank: int, t: float) -> tuple[float, float]:
        """Return (steps done, this rank's compute seconds in them) at ``t``: every rank
        steps at the slowest one's pace; a hang stops every rank."""
        hangs = self._struck("hang", t)
        if hangs:
            t = min(f.at for f in hangs)
        compute = COMPUTE_SHARE * self.step_seconds * self._jitter(rank)
        slow = sorted(self._struck("straggler", t), key=lambda f: f.at)
        if not slow:
            steps = max(0.0, t - self.started_at) / self.step_seconds
            return steps, steps * compute
        first = slow[0]
        before = max(0.0, first.at - self.started_at) / self.step_seconds
        extra = max(f.factor for f in slow) - 1.0
        period = self.step_seconds + COMPUTE_SHARE * self.step_seconds * extra
        after = (t - first.at) / period
        mine = 1.0 + extra if rank in {f.rank for f in slow} else 1.0
        return before + after, before * compute + after * compute * mine

    def _jitter(self, rank: int) -> float:
        return _jitter(rank)

    def last_written(self, rank: int, now: float) -> float | None:
        """Return when ``rank`` last wrote its heartbeat by ``now`` (None: not yet)."""
        offset = (rank % 16) / 16 * self.heartbeat_seconds  # ranks write out of step
        silenced = [f.at for f in self.faults if f.at <= now and (
            (f.kind == "stop_rank" and f.rank == rank)
            or (f.kind == "stop_node" and f.node == self.node_of(rank)))]
        until = min([now, *silenced])
        since = until - self.started_at - offset
        if since < 0:
            return None
        return self.started_at + offset + math.floor(since / self.heartbeat_seconds) \
            * self.heartbeat_seconds

    def heartbeat(self, rank: int, now: float) -> Heartbeat | None:
        """Return ``rank``'s heartbeat as its file would hold it at ``now`` (None: none yet)."""
        written = self.last_written(rank, now)
        if written is None:
            return None
        steps, compute_total = self._steps(rank, written)
        step = int(steps)
        hangs = self._struck("hang", written)
        if hangs:
            hang = min(hangs, key=lambda f: f.at)
            phase = Phase.COMPUTE if rank == hang.rank else Phase.COLLECTIVE
            phase_started = hang.at
        else:
            into = steps - step
            phase = Phase.COMPUTE if into < COMPUTE_SHARE else Phase.COLLECTIVE
            phase_started = written - (into if phase is Phase.COMPUTE
                                       else into - COMPUTE_SHARE) * self.step_seconds
        per_step = compute_total / steps if steps else COMPUTE_SHARE * self.step_seconds
        slow = [f for f in self._struck("straggler", written) if f.rank == rank]
        if slow:
            per_step = COMPUTE_SHARE * self.step_seconds * self._jitter(rank) * slow[0].factor
        return Heartbeat(rank=rank, node=self.node_of(rank), pid=1, step=step,
                         phase=phase.value if step else Phase.STARTING.value,
                         phase_started_at=phase_started, compute_seconds=per_step,
                         compute_total=compute_total, samples_per_second=1000.0, loss=2.0,
                         wall_clock=written, seq=int((written - self.started_at) * 2))

    def report(self, node: str, now: float) -> list[dict[str, Any]]:
        """Return what ``node``'s agent's status says of its ranks: heartbeats with ages."""
        beats = []
        for rank in self.ranks_of(node):
            beat = self.heartbeat(rank, now)
            if beat is None:
                continue
            record = dict(vars(beat))  # what to_json writes, without its deep copy
            record[wire.AGE_SECONDS] = now - beat.wall_clock
            record[wire.PHASE_AGE_SECONDS] = now - beat.phase_started_at
            beats.append(record)
        return beats


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
    """Serve every simulated node's channel from one thread."""

    def __init__(self, cluster: Cluster, attempt_id: str, root: Path, secret: str,
                 group_size: int = 0) -> None:
        self.cluster = cluster
        self.servers: dict[str, Any] = {}  # node -> its (never started) AgentServer's httpd
        agents = {}
        for n in range(cluster.nodes):
            node = cluster.node_name(n)
            agents[node] = SimAgent(cluster, node, attempt_id, root)
            self.servers[node] = self._serve(agents[node], secret)
        self.groups: dict[str, list[str]] = {}  # aggregator -> its nodes
        cut = groups_of(list(agents), group_size) if group_size > 0 else []
        for g, nodes in enumerate(cut):
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
    secret = sys.stdin.readline().strip()  # the channel secret: not on the command line
    cluster = Cluster(nodes, per_node, time.time())
    sim = Simulator(cluster, attempt_id, root, secret, group_size)
    write_atomically(root / PORTS_FILE, json.dumps({"ports": sim.ports(),
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
