"""One snapshot of a segment attempt, as the watcher saw it, and the phases the rules read.

The detection rules (:mod:`relay.watch.detection`, :mod:`relay.watch.hangs`) judge
an :class:`Observation`: the heartbeats, the launcher's status, the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from relay.launchers.base import LaunchStatus
from relay.watch.columns import RankColumns
from relay_train.protocol.heartbeat import Heartbeat, Phase

# The phases as the plain strings heartbeats carry: the rules look at every rank each
# poll, and an enum member's ``.value`` costs a descriptor call each time (~10% of a poll).
STARTING, COMPUTE, CHECKPOINT, DONE = (
    Phase.STARTING.value, Phase.COMPUTE.value, Phase.CHECKPOINT.value, Phase.DONE.value)
WAITING = {Phase.COLLECTIVE.value}
WORKING = {COMPUTE, Phase.COLLECTIVE.value}


@dataclass
class Observation:
    """One snapshot of a segment attempt, as the watcher saw it."""

    now: float
    launched_at: float
    heartbeats: dict[int, Heartbeat]
    node_ranks: dict[str, list[int]]
    heartbeat_interval: float
    launch: LaunchStatus | None = None  # None when watching a job Relay did not launch

    @property
    def expected_ranks(self) -> list[int]:
        """Return every rank the job should have."""
        return sorted(r for ranks in self.node_ranks.values() for r in ranks)

    @cached_property
    def _rank_nodes(self) -> dict[int, str]:
        """Return rank -> its node (the first node listing it), built once per snapshot:
        a scan of every node per rank is quadratic (~0.8 s a poll at 1,024 nodes x 8)."""
        nodes: dict[int, str] = {}
        for node, ranks in self.node_ranks.items():
            for rank in ranks:
                nodes.setdefault(rank, node)
        return nodes

    @cached_property
    def columns(self) -> RankColumns:
        """Return the heartbeats as columns (:mod:`relay.watch.columns`), built once."""
        return RankColumns.of(self.heartbeats.values())

    def node_of(self, rank: int) -> str | None:
        """Return the node a rank runs on."""
        return self._rank_nodes.get(rank)


def past_startup(obs: Observation) -> bool:
    """Return whether any rank got past start-up (then every rank rendezvoused)."""
    return any(b.phase != STARTING for b in obs.heartbeats.values())
