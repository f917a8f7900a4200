"""The agent simulator's model of a data-parallel job on the clock, and its scripted faults.

:class:`Cluster` says what each simulated rank's heartbeat would hold at any time (every
rank steps at the slowest one's pace; a hang stops them all), and whether each node's
agent answers, given the :class:`SimFault` s struck so far. :mod:`relay.tools.bench.agent_sim`
serves it over the real channel.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

from relay_train.protocol import routes as wire
from relay_train.protocol.heartbeat import Heartbeat, Phase

SIM_KINDS = ("stop_node", "stop_rank", "hang", "straggler", "partition")
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

    def _stalls(self, t: float) -> list[SimFault]:
        """Return the faults struck by ``t`` that stop every rank at its next collective:
        a hang, a silenced rank, a frozen node (the ranks step in lockstep)."""
        return [f for f in self.faults if f.at <= t
                and (f.kind in ("hang", "stop_rank")
                     or (f.kind == "stop_node" and self.is_node(f.node)))]

    def is_node(self, name: str | None) -> bool:
        """Return whether ``name`` is one of the job's nodes (not an aggregator)."""
        return name is not None and name.startswith("node-")

    def _steps(self, rank: int, t: float) -> tuple[float, float]:
        """Return (steps done, this rank's compute seconds in them) at ``t``: every rank
        steps at the slowest one's pace; a stall (:meth:`_stalls`) stops every rank."""
        stalls = self._stalls(t)
        if stalls:
            t = min(f.at for f in stalls)
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
        stalls = self._stalls(written)
        if stalls:
            stall = min(stalls, key=lambda f: f.at)
            held = stall.kind == "hang" and rank == stall.rank
            phase = Phase.COMPUTE if held else Phase.COLLECTIVE
            phase_started = stall.at
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
                         wall_clock=written, seq=int((written - self.started_at) * 2),
                         step_seconds=self.step_seconds, cpu_wait_seconds=0.0,
                         cpu_wait_total=0.0, phase_cpu_wait=0.0)  # a host with cores to spare

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
