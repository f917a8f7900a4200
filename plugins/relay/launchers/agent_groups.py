"""Asking many agents at once: one aggregator per group of nodes, one signed summary each.

At a thousand nodes, one signed HTTP request per node and per poll costs the watcher a
core or two (``relay bench watcher``). So a large attempt's nodes are cut into groups
(:func:`groups_of`, :data:`GROUP_SIZE` nodes each); an aggregator per group
(:mod:`relay.launchers.aggregator`) asks its group's agents over the same signed channel
and serves one signed ``summary`` (:data:`~relay_train.protocol.routes.Route.SUMMARY`):
per node, its agent's status, heartbeats as rows of
:data:`~relay_train.protocol.routes.BEAT_FIELDS`, and ``seen_age_seconds``, how long ago
the aggregator last heard that agent. The watcher places each node's answer on its own
clock at ``received - seen_age`` (the heartbeats' ages then count from there, as on the
direct path), so a node that froze ages there as it would if asked directly.

A summary is the aggregator's word only: an aggregator that does not answer, answers
unsigned, or whose every node is stale (its own loop stuck) is *unknown*, never a group
of dead nodes: :class:`GroupWatch` says which groups to ask directly instead, until
their aggregator answers again. Jobs of at most :data:`DIRECT_MAX_NODES` nodes have no
aggregators: every agent is asked directly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from relay_train.protocol.heartbeat import Heartbeat
from relay_train.protocol.routes import (
    AGE_SECONDS,
    BEAT_FIELDS,
    BEATS,
    CROSSED,
    EXIT_CODES,
    HEARTBEATS,
    NODE,
    NODES,
    PHASE_AGE_SECONDS,
    SEEN_AGE_SECONDS,
    STATE,
)
from relay_train.protocol.routes import ERRORS as NODE_ERRORS

log = logging.getLogger(__name__)

GROUP_SIZE = 32  # nodes per aggregator
DIRECT_MAX_NODES = 32  # up to this many nodes, the watcher asks every agent itself
AGGREGATE_SECONDS = 0.2  # how often an aggregator asks its group's agents
GROUP_WAIT_SECONDS = 0.5  # a poll waits this long for the summaries
# An aggregator with no fresh summary for this long while others give theirs is down: its
# nodes are asked directly (GroupWatch).
# Their answers reach the watcher at most a heartbeat interval + an aggregator round + this
# + a poll late: under the default 2 s heartbeat_timeout.
DOWN_AFTER_SECONDS = 0.8
ALL_DOWN_AFTER_SECONDS = 1.5  # ...likewise, when no aggregator gave one for this long
# A summary whose every node was last heard longer ago than this is its aggregator's
# silence (its loop stuck), not its nodes': that group is asked directly.
STALE_SUMMARY_SECONDS = 1.0
_STATUS_KEYS = (STATE, EXIT_CODES, NODE_ERRORS, CROSSED)
_AGE_COLUMN = BEAT_FIELDS.index(AGE_SECONDS)  # followed by PHASE_AGE_SECONDS
# A row's fields as decode_node reads them: each age in the slot of the time it gives.
_ROW_KEYS = tuple({AGE_SECONDS: "wall_clock", PHASE_AGE_SECONDS: "phase_started_at"}.get(f, f)
                  for f in BEAT_FIELDS)
_ROW_LENGTH = len(BEAT_FIELDS)
# The per-step figures and totals, sent to the microsecond: their full float reprs made
# the watcher's JSON parse ~45% slower at 1,024 nodes (34 -> 24 ms a poll with these cut).
_ROUNDED = tuple(BEAT_FIELDS.index(f) for f in (
    "compute_seconds", "compute_total", "samples_per_second", "step_seconds",
    "cpu_wait_seconds", "cpu_wait_total", "phase_cpu_wait"))


@dataclass(frozen=True)
class Group:
    """One aggregator: its name (as a channel peer), its address, and its nodes."""

    name: str
    address: str
    nodes: tuple[str, ...]


def groups_of(nodes: list[str], size: int = GROUP_SIZE) -> list[list[str]]:
    """Cut ``nodes`` into groups of at most ``size`` (none when few enough to ask directly)."""
    if len(nodes) <= DIRECT_MAX_NODES:
        return []
    return [nodes[i:i + size] for i in range(0, len(nodes), size)]


def beat_row(record: dict[str, Any]) -> list[Any]:
    """Return one status heartbeat record (with its ages, to a tenth of a ms) as a summary row."""
    row = [record.get(name) for name in BEAT_FIELDS]
    row[_AGE_COLUMN] = round(float(row[_AGE_COLUMN]), 4)
    row[_AGE_COLUMN + 1] = round(float(row[_AGE_COLUMN + 1]), 4)
    for i in _ROUNDED:
        if type(row[i]) is float:
            row[i] = round(row[i], 6)
    return row


def encode_summary(heard: dict[str, tuple[float, dict[str, Any]]], now: float) -> dict[str, Any]:
    """Return the summary of ``heard`` (node -> when its agent answered, its status record),
    with times as ages at ``now`` on the aggregator's clock."""
    nodes = {}
    for node, (at, record) in heard.items():
        entry = {k: record[k] for k in _STATUS_KEYS if k in record}
        entry[SEEN_AGE_SECONDS] = round(now - at, 4)
        entry[BEATS] = [beat_row(b) for b in record.get(HEARTBEATS) or []]
        nodes[node] = entry
    return {NODES: nodes}


def decode_node(node: str, entry: dict[str, Any], received_at: float
                ) -> tuple[float, dict[str, Any], dict[int, Heartbeat], set[int]]:
    """Return one node's answer from a summary: when its agent answered (on our clock), its
    status record, its heartbeats (on our clock) and the boundaries it reported crossed."""
    heard_at = received_at - float(entry[SEEN_AGE_SECONDS])
    beats: dict[int, Heartbeat] = {}
    keys, new = _ROW_KEYS, object.__new__  # (8,192 rows a poll at 1,024 nodes: hoisted)
    for row in entry.get(BEATS) or []:
        try:
            if len(row) != _ROW_LENGTH:  # (as zip(..., strict=True) would, at less cost)
                raise ValueError(f"{len(row)} fields, not {_ROW_LENGTH}")
            fields = dict(zip(keys, row, strict=False))
            fields["node"] = node
            fields["wall_clock"] = heard_at - fields["wall_clock"]  # the ages, placed
            fields["phase_started_at"] = heard_at - fields["phase_started_at"]
            rank = fields["rank"]
        except (TypeError, ValueError) as exc:
            log.debug("Skipping a bad heartbeat row of %s: %s", node, exc)
            continue
        if type(rank) is not int:
            log.debug("Skipping a heartbeat row of %s with rank %r", node, rank)
            continue
        # Every field is given (BEAT_FIELDS, the node, the two times): set them as they are,
        # at a fifth of __init__'s keyword binding, 8,192 times a poll at 1,024 nodes.
        beat = new(Heartbeat)
        beat.__dict__ = fields
        beats[rank] = beat
    record = {k: entry[k] for k in (STATE, EXIT_CODES, NODE_ERRORS) if k in entry}
    return heard_at, {NODE: node, **record}, beats, crossed_steps(node, entry.get(CROSSED))


def crossed_steps(node: str, reported: object) -> set[int]:
    """Return the boundary steps a node's agent reported crossed (the bad ones skipped)."""
    crossed = set()
    for step in reported if isinstance(reported, list) else []:
        try:
            crossed.add(int(step))
        except (TypeError, ValueError):
            log.debug("Skipping a bad boundary step from %s: %r", node, step)
    return crossed


def fresh(summary: dict[str, Any]) -> bool:
    """Return whether a summary shows its aggregator at work: some node heard lately."""
    nodes = summary.get(NODES)
    if not isinstance(nodes, dict) or not nodes:
        return False
    try:
        return min(float(e[SEEN_AGE_SECONDS]) for e in nodes.values()) <= STALE_SUMMARY_SECONDS
    except (KeyError, TypeError, ValueError):
        return False


class GroupWatch:
    """Which groups' aggregators speak for them now; the others' nodes are asked directly.

    An aggregator is down once its last fresh, signed summary is :data:`DOWN_AFTER_SECONDS`
    older than another aggregator's latest (one frozen among others that answer), or
    :data:`ALL_DOWN_AFTER_SECONDS` old (all of them silent). Late answers all round are the
    watcher's own host starved, which asking every agent directly would only make worse
    (ten times the requests); meanwhile the nodes keep their last answers, which age
    honestly.
    """

    def __init__(self, groups: list[Group], now: float | None = None) -> None:
        self.groups = {g.name: g for g in groups}
        now = time.time() if now is None else now
        self.heard = {g.name: now for g in groups}  # when each last gave a fresh summary
        self.down: set[str] = set()

    def answered(self, name: str, at: float) -> None:
        """Record a fresh, signed summary from ``name`` received at ``at``."""
        self.heard[name] = max(self.heard[name], at)

    def direct_nodes(self, now: float) -> set[str]:
        """Return the nodes to ask directly at ``now``: those of the aggregators down."""
        newest = max(self.heard.values(), default=now)
        for name, group in self.groups.items():
            heard = self.heard[name]
            working = newest - heard <= DOWN_AFTER_SECONDS and now - heard <= ALL_DOWN_AFTER_SECONDS
            if working and name in self.down:
                log.info("Aggregator %s answers again: its %d nodes are read through it",
                         name, len(group.nodes))
                self.down.discard(name)
            elif not working and name not in self.down:
                log.warning("Aggregator %s gave no fresh summary for %.1fs: asking its %d nodes "
                            "directly until it does", name, now - heard, len(group.nodes))
                self.down.add(name)
        return {n for name in self.down for n in self.groups[name].nodes}
