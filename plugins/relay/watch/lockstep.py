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

from relay.watch.observation import StepSeen
from relay_train.protocol.heartbeat import Heartbeat


class Lockstep:
    """Remember when each rank last moved on a step; answer each node's latest proof of life."""

    def __init__(self) -> None:
        # rank -> the wall clock of its last record before its step last moved on
        self._moved_after: dict[int, float] = {}
        self._last: dict[int, StepSeen] = {}  # rank -> the step and wall clock last seen

    def observe(self, beats: dict[int, Heartbeat]) -> None:
        """Fold in one poll's records."""
        last_of, moved_after = self._last, self._moved_after  # (8,192 ranks a poll: hoisted)
        for rank, beat in beats.items():
            step, wall_clock = beat.step, beat.wall_clock
            last = last_of.get(rank)
            if last is None:
                last_of[rank] = StepSeen(step, wall_clock)
            elif step != last.step or wall_clock > last.at:
                if step > last.step:
                    moved_after[rank] = last.at
                last.step, last.at = step, wall_clock

    def alive_since(self, nodes: list[str], node_of: Callable[[int], str | None],
                    ) -> dict[str, float]:
        """Return node -> the latest time other nodes' steps show its ranks were alive
        (empty: fewer than two nodes stepped)."""
        best: dict[str, float] = {}  # node -> the latest proof its ranks give the others
        for rank, after in self._moved_after.items():
            node = node_of(rank)
            if node is not None and after > best.get(node, -math.inf):
                best[node] = after
        if len(best) < 2:
            return {}
        (top_node, top), (_, second) = sorted(best.items(), key=lambda i: i[1], reverse=True)[:2]
        return {node: second if node == top_node else top for node in nodes}
