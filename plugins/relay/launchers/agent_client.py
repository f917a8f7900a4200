"""Relay's side of the channel to the node agents (the agents' side: relay_train.agent.server).

Routes, fields and node states are those of :mod:`relay_train.protocol.routes`.

Everything the watcher, drain, rescue and evidence need from a running attempt
comes from here, over HTTP with short timeouts, never from a file a node wrote.
Launchers own one :class:`AgentChannel` per attempt they watch and say where its
agents are (``node -> http://host:port``, or ``https://`` with the TLS context the
channel verifies them by, where the channel crosses hosts: see
:mod:`relay_train.protocol.channel_tls`).

Clocks: an agent reports each heartbeat's age on its own clock; the channel
places the beat on Relay's clock as ``received_at - age`` (and the same for the
phase start), so a node whose wall clock is off raises no false alarm. An
agent's ``last_seen`` is when Relay last heard from it, on Relay's clock.

Boundaries: the agent of the node hosting rank 0 reports the last segment boundaries
rank 0 recorded crossing; the channel keeps every one it heard of
(:attr:`AgentChannel.crossed`), so a silent agent's last word still counts.

Trust (each request: :mod:`relay.launchers.agent_requests`): every request is
signed with the attempt's channel secret, and a reply is used
only if the agent signed it back (:mod:`relay_train.protocol.channel_auth`). An agent
that refuses our credential (401: another attempt's agent, or no agent of ours at all)
is refused in turn and recorded like a stale one, with nothing it said; a reply that is
not signed is not an answer. Node clocks play no part: the agent's replay window is
minutes wide either way.

Fencing: every request names the attempt; a reply from an agent serving another
attempt (a 409, or a body naming another attempt) is refused: nothing in it is
used, a warning is logged and the refusal is kept in :attr:`AgentChannel.refused`
(Relay records it with the attempt's decision).
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.core.exceptions import StaleAgentError
from relay.launchers.agent_groups import (
    GROUP_WAIT_SECONDS,
    Group,
    GroupWatch,
    crossed_steps,
    decode_node,
    fresh,
)
from relay.launchers.agent_requests import AgentRequests
from relay_train.protocol.heartbeat import Heartbeat, write_atomically
from relay_train.protocol.injection import CHAOS_LOG
from relay_train.protocol.launch import FIRST_STEP_FILE
from relay_train.protocol.routes import (
    AGE_SECONDS,
    CHAOS,
    CROSSED,
    FIRST_STEP,
    HEARTBEATS,
    NODES,
    PHASE_AGE_SECONDS,
    Route,
)

log = logging.getLogger(__name__)

# A poll waits this long for the agents' answers; a slower answer is not thrown away: it
# counts at the next poll, with the time it arrived. A status request still unanswered
# after STATUS_TIMEOUT_SECONDS (a frozen agent) is given up and asked again.
FRESH_WAIT_SECONDS = 1.0
STATUS_TIMEOUT_SECONDS = 10.0
MAX_PARALLEL = 32  # agents asked at once (a frozen one costs its timeout, not the others')
# A stop asks each agent this long before the launcher signals or deletes (a frozen agent
# costs it once: the agents are asked at once).
STOP_ASK_TIMEOUT_SECONDS = 1.0


@dataclass
class NodeReport:
    """One agent's status reply, placed on Relay's clock."""

    node: str
    received_at: float
    record: dict[str, Any]
    heartbeats: dict[int, Heartbeat] = field(default_factory=dict)
    crossed: set[int] = field(default_factory=set)  # boundaries rank 0 recorded crossing
    round_trip: float | None = None  # seconds from asking to the answer (relay.watch.slow_link)


def place_on_our_clock(record: dict[str, Any], received_at: float) -> Heartbeat:
    """Return a heartbeat reported with ages, its times moved to Relay's clock."""
    beat = Heartbeat.from_record(record)  # already parsed: no JSON round trip (8 per node)
    beat.wall_clock = received_at - float(record[AGE_SECONDS])
    beat.phase_started_at = received_at - float(record[PHASE_AGE_SECONDS])
    return beat


class AgentChannel(AgentRequests):
    """Talk to the agents of one attempt; remember what they last said."""

    def __init__(self, attempt_id: str, addresses: dict[str, str], secret: str,
                 tls: ssl.SSLContext | None = None, groups: list[Group] | None = None) -> None:
        self.attempt_id = attempt_id
        self._secret = secret  # the attempt's channel secret: never logged
        self.addresses = dict(addresses)
        # A large attempt's aggregators (relay.launchers.agent_groups): a poll reads their
        # groups through them, and asks a group's agents directly while its aggregator is down.
        self.groups = GroupWatch(groups or [])
        self.aggregators = {g.name: g.address for g in groups or []}
        self.tls = tls  # for https:// addresses: relay_train.protocol.channel_tls.client_context
        self.tls_refused: set[str] = set()  # nodes whose TLS handshake failed (warned once)
        self.refused: list[dict[str, Any]] = []
        self.reports: dict[str, NodeReport] = {}
        self.beats: dict[int, Heartbeat] = {}
        self.crossed: set[int] = set()  # every boundary rank 0 was heard to have crossed
        self._pool: ThreadPoolExecutor | None = None
        # The aggregators' own threads: a summary never queues behind the direct requests
        # to a down aggregator's nodes (which made the others late, then down, in turn).
        self._group_pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future[NodeReport | None]] = {}
        self.silent: set[str] = set()  # nodes known not to answer (a frozen node): not asked
        self._strikes_kept = 0  # the injected faults written into Relay's chaos.jsonl so far

    def keep_node_records(self, attempt_dir: Path) -> None:
        """Write what the ranks recorded on their own disk (a pod's or a host's), as their
        agents sent it, into Relay's attempt folder: rank 0's first-step record and the
        faults injected so far (``chaos.jsonl``, every node's, oldest first). The time to
        resume and the fault table read them there (relay.lineage.resume_time, .report)."""
        target = attempt_dir / FIRST_STEP_FILE
        for report in self.reports.values():
            found = report.record.get(FIRST_STEP)
            if isinstance(found, dict) and not target.exists():
                write_atomically(target, json.dumps(found))
        strikes = [s for r in self.reports.values() for s in r.record.get(CHAOS) or []
                   if isinstance(s, dict)]
        if len(strikes) > self._strikes_kept:
            strikes.sort(key=lambda s: float(s.get("at") or 0.0))
            write_atomically(attempt_dir / CHAOS_LOG,
                             "".join(json.dumps(s) + "\n" for s in strikes))
            self._strikes_kept = len(strikes)

    def mark_silent(self, nodes: set[str]) -> None:
        """Stop asking ``nodes`` (a fault found them frozen): each ask would only cost its
        timeout. Their last answers are kept."""
        self.silent |= nodes & set(self.addresses)

    def ask_to_stop(self, nodes: list[str] | None = None,
                    timeout: float = STOP_ASK_TIMEOUT_SECONDS) -> set[str]:
        """Ask every agent (or ``nodes``') to stop, all at once; return those that said yes.

        Every launcher's stop starts here, before its signal or delete: an agent that was
        asked takes the SIGTERM that follows as Relay's stop, not as a platform's preemption
        notice (:mod:`relay_train.agent.notice`). A silent node is not asked.
        """
        targets = [n for n in (self.addresses if nodes is None else nodes)
                   if n in self.addresses and n not in self.silent]
        if not targets:
            return set()
        with ThreadPoolExecutor(max_workers=min(len(targets), MAX_PARALLEL),
                                thread_name_prefix="relay-stop") as pool:
            replies = list(pool.map(lambda n: self.call_quietly(n, Route.STOP, timeout), targets))
        return {n for n, reply in zip(targets, replies, strict=True) if reply is not None}

    # -- status of every node --------------------------------------------------------

    def poll(self, nodes: list[str] | None = None) -> dict[str, NodeReport | None]:
        """Ask every agent (or ``nodes``') for its status; return the answers that came.

        Never waits more than :data:`FRESH_WAIT_SECONDS`: a slow agent's answer is kept
        for the next poll (with the time it arrived), so a loaded host is not a silent one.
        A poll waits only for the requests it sent: one still unanswered from an earlier
        poll (a frozen agent's) had its wait, so a frozen agent costs one wait, not one per
        poll (which made the watcher look every 1.5 s instead of every 0.5 s just when a
        node froze).
        """
        targets = [n for n in (self.addresses if nodes is None else nodes)
                   if n in self.addresses and n not in self.silent]
        if not targets:
            return {}
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=MAX_PARALLEL,
                                            thread_name_prefix="relay-channel")
        replies: dict[str, NodeReport | None] = {}
        if self.groups.groups:
            covered = self._poll_groups()
            replies.update({n: self.reports.get(n) for n in targets if n in covered})
            targets = [n for n in targets if n not in covered]
        sent = []
        for node in targets:
            if node not in self._inflight:
                self._inflight[node] = self._pool.submit(self._status, node)
                sent.append(self._inflight[node])
        wait(sent, timeout=FRESH_WAIT_SECONDS)
        for node in targets:
            future = self._inflight[node]
            if not future.done():
                replies[node] = None
                continue
            report = self._take(node, "status")
            replies[node] = report
            if report is not None:
                self._keep(report)
        return replies

    def _take(self, peer: str, what: str) -> Any:  # noqa: ANN401
        """Return the answer of ``peer``'s request in flight (done), None if it failed."""
        future = self._inflight.pop(peer)
        try:
            return future.result()
        except Exception:  # noqa: BLE001 - one peer's bad answer is not the watcher's end
            log.exception("Reading the %s of %s failed", what, peer)
            return None

    def _keep(self, report: NodeReport) -> None:
        """Keep ``report`` if it is newer than what its node last said."""
        known = self.reports.get(report.node)
        if known is None or report.received_at > known.received_at:
            self.reports[report.node] = report
            self.beats.update(report.heartbeats)
            self.crossed |= report.crossed

    def _poll_groups(self) -> set[str]:
        """Ask every aggregator for its summary and keep what the fresh ones say; return the
        nodes not to ask directly (those of the aggregators not down)."""
        watch = self.groups
        if self._group_pool is None:
            self._group_pool = ThreadPoolExecutor(max_workers=min(len(watch.groups), MAX_PARALLEL),
                                                  thread_name_prefix="relay-aggregators")
        sent = []
        for name in watch.groups:
            if name not in self._inflight:
                self._inflight[name] = self._group_pool.submit(self._summary, name)
                if name not in watch.down:  # a down one's answer is used when it comes
                    sent.append(self._inflight[name])
        wait(sent, timeout=GROUP_WAIT_SECONDS)
        for name, group in watch.groups.items():
            future = self._inflight[name]
            if not future.done():
                continue
            answer = self._take(name, "summary")
            if answer is not None and fresh(answer[1]):
                watch.answered(name, answer[0])
                self._merge(group, *answer)
        direct = watch.direct_nodes(time.time())
        return {n for g in watch.groups.values() for n in g.nodes if n not in direct}

    def _summary(self, name: str) -> tuple[float, dict[str, Any]] | None:
        try:
            reply = self.call(name, Route.SUMMARY, timeout=STATUS_TIMEOUT_SECONDS)
        except StaleAgentError:
            return None
        return (time.time(), reply) if isinstance(reply, dict) else None

    def _merge(self, group: Group, received_at: float, summary: dict[str, Any]) -> None:
        """Keep what a summary says of each node of ``group`` (of no other node)."""
        for node, entry in (summary.get(NODES) or {}).items():
            if node not in group.nodes or not isinstance(entry, dict):
                continue
            try:
                heard_at, record, beats, crossed = decode_node(node, entry, received_at)
            except (KeyError, TypeError, ValueError) as exc:
                log.debug("Skipping %s in the summary of %s: %s", node, group.name, exc)
                continue
            self._keep(NodeReport(node, heard_at, record, beats, crossed))

    def close(self) -> None:
        """Give up the requests in flight (a frozen agent's) and free the threads."""
        for pool in (self._pool, self._group_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._group_pool = None
        self._inflight.clear()

    def _status(self, node: str) -> NodeReport | None:
        asked = time.monotonic()
        try:
            record = self.call(node, Route.STATUS, timeout=STATUS_TIMEOUT_SECONDS)
        except StaleAgentError:
            return None
        if not isinstance(record, dict):
            return None
        received_at = time.time()
        beats = {}
        for raw in record.get(HEARTBEATS) or []:
            try:
                beat = place_on_our_clock(raw, received_at)
            except (KeyError, TypeError, ValueError) as exc:
                log.debug("Skipping a bad heartbeat from %s: %s", node, exc)
                continue
            beats[beat.rank] = beat
        return NodeReport(node, received_at, record, beats,
                          crossed_steps(node, record.get(CROSSED)), time.monotonic() - asked)

    def last_seen(self, node: str) -> float | None:
        """Return when ``node``'s agent last answered, on Relay's clock."""
        report = self.reports.get(node)
        return None if report is None else report.received_at

