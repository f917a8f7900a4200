"""Proof of life from the ranks' lockstep: when a node unheard for a while is not silent.

The ranks of a data-parallel job step in lockstep (every step ends in a collective
every rank joins; :mod:`relay.watch.steptime` assumes the same). So a rank that
finished a step after its record written at time ``t`` had every other rank answer
that collective after ``t``: the other ranks were alive then, whatever their own
records say.

On a loaded machine a node's agent (and so its ranks' records, which come through
it) can go unheard for longer than ``heartbeat_timeout`` while its answer waits for
a core, and the job steps on meanwhile; measured with `relay bench detect --load`,
that was every false alarm under 2x oversubscription. A frozen node (or a stopped
rank) stops every other rank at the next collective, so the proof ends within a step
of the fault and calls nothing later.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from relay.watch.columns import RankArrays, RankColumns


class Lockstep:
    """Remember when each rank last moved on a step; answer each node's latest proof of life."""

    def __init__(self) -> None:
        # per rank: the step and wall clock last seen, and the wall clock of its last
        # record before its step last moved on (arrays indexed by rank: relay.watch.columns)
        self._last = RankArrays(step=(np.int64, 0), at=(np.float64, 0.0),
                                moved_after=(np.float64, -math.inf))

    def observe(self, cols: RankColumns) -> None:
        """Fold in one poll's records."""
        last = self._last
        last.fit(cols.rank)
        rank, step, wall_clock = cols.rank, cols.step, cols.wall_clock
        seen, last_step, last_at = last.seen[rank], last["step"][rank], last["at"][rank]
        changed = seen & ((step != last_step) | (wall_clock > last_at))
        moved = changed & (step > last_step)
        last["moved_after"][rank[moved]] = last_at[moved]
        fresh = changed | ~seen
        last["step"][rank[fresh]], last["at"][rank[fresh]] = step[fresh], wall_clock[fresh]
        last.seen[rank] = True

    def moved_after(self) -> dict[int, float]:
        """Return rank -> the wall clock of its last record before its step last moved on."""
        after = self._last["moved_after"]
        return self._last.by_rank("moved_after", where=after > -math.inf)

    def last_seen(self) -> dict[int, tuple[int, float]]:
        """Return rank -> the step and wall clock last seen."""
        return self._last.by_rank("step", "at")

    def alive_since(self, nodes: list[str], node_of: Callable[[int], str | None],
                    ) -> dict[str, float]:
        """Return node -> the latest time other nodes' steps show its ranks were alive
        (empty: fewer than two nodes stepped)."""
        return alive_since(self.moved_after(), nodes, node_of)


def alive_since(moved_after: dict[int, float], nodes: list[str],
                node_of: Callable[[int], str | None]) -> dict[str, float]:
    """Return node -> the latest time other nodes' steps show its ranks were alive, from
    each rank's last record before its step moved on (empty: fewer than two nodes)."""
    best: dict[str, float] = {}  # node -> the latest proof its ranks give the others
    for rank, after in moved_after.items():
        node = node_of(rank)
        if node is not None and after > best.get(node, -math.inf):
            best[node] = after
    if len(best) < 2:
        return {}
    (top_node, top), (_, second) = sorted(best.items(), key=lambda i: i[1], reverse=True)[:2]
    return {node: second if node == top_node else top for node in nodes}
