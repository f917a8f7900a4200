"""One poll's heartbeats as columns, and per-rank state kept in arrays: rules over every rank.

At 1,024 nodes x 8 ranks, a rule that walks the 8,192 :class:`Heartbeat` objects in
Python and keeps a record per rank costs milliseconds a poll, every poll
(``relay.tools.bench.watcher_probe``); the same over numpy arrays costs tens of
microseconds. :class:`RankColumns` takes the fields those rules read off the records once
a poll (:meth:`Observation.columns <relay.watch.observation.Observation.columns>`), and
:class:`RankArrays` keeps a rule's per-rank figures indexed by rank. A rule then finds
the few ranks worth a closer look (a stall, a step that moved) with array operations,
and looks at those alone.

On columns: the stepping ranks (:class:`~relay.watch.detection.Detector`), the lockstep
proof, the step-time samples, the hang rule, the silent ranks, ``due_at`` and the
straggler rule. Not yet: the NaN and throughput rules, and the summaries themselves,
which are still decoded into one heartbeat object a rank before the columns are read
off them (``relay.launchers.agent_groups.decode_node``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from functools import cached_property

import numpy as np
import numpy.typing as npt

from relay_train.protocol.heartbeat import Heartbeat, Phase

log = logging.getLogger(__name__)

MAX_RANKS = 1 << 20  # a record of a higher rank is no job's: per-rank arrays stop here
PHASES = tuple(p.value for p in Phase)
PHASE_CODES = {name: code for code, name in enumerate(PHASES)}
UNKNOWN_PHASE = -1  # a phase this watcher does not know (a newer worker's)

Ints = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]
Flags = npt.NDArray[np.bool_]


def code_of(phase: str) -> int:
    """Return the code :class:`RankColumns` gives ``phase``."""
    return PHASE_CODES.get(phase, UNKNOWN_PHASE)


class RankColumns:
    """The fields the rules read from every rank's record, one array each, in the order of
    the records: ``beats[i]`` is row ``i``. Each field is read off the records the first
    time a rule asks for it, once a poll however many rules use it."""

    def __init__(self, beats: list[Heartbeat], rank: Ints) -> None:
        self.beats = beats
        self.rank = rank
        self._parent: RankColumns | None = None  # (subset: its fields index the parent's)
        self._index: Ints = rank

    @classmethod
    def of(cls, records: Iterable[Heartbeat]) -> RankColumns:
        """Return the columns of ``records`` (those with a rank in [0, MAX_RANKS) alone:
        per-rank arrays are indexed by rank)."""
        beats = list(records)
        rank = np.array([b.rank for b in beats], np.int64)
        if ((rank < 0) | (rank >= MAX_RANKS)).any():
            log.debug("Leaving out records with a rank outside [0, %d)", MAX_RANKS)
            beats = [b for b in beats if 0 <= b.rank < MAX_RANKS]
            rank = np.array([b.rank for b in beats], np.int64)
        return cls(beats, rank)

    # (list comprehensions, then arrays: faster here than np.fromiter over a generator)
    @cached_property
    def step(self) -> Ints:
        if self._parent is not None:
            return self._parent.step[self._index]
        return np.array([b.step for b in self.beats], np.int64)

    @cached_property
    def phase(self) -> npt.NDArray[np.int8]:
        """PHASE_CODES, UNKNOWN_PHASE for any other."""
        if self._parent is not None:
            return self._parent.phase[self._index]
        codes = PHASE_CODES.get
        return np.array([codes(b.phase, UNKNOWN_PHASE) for b in self.beats], np.int8)

    @cached_property
    def wall_clock(self) -> Floats:
        if self._parent is not None:
            return self._parent.wall_clock[self._index]
        return np.array([b.wall_clock for b in self.beats], np.float64)

    @cached_property
    def phase_started_at(self) -> Floats:
        if self._parent is not None:
            return self._parent.phase_started_at[self._index]
        return np.array([b.phase_started_at for b in self.beats], np.float64)

    @cached_property
    def phase_cpu_wait(self) -> Floats:
        """0 where the rank did not say."""
        if self._parent is not None:
            return self._parent.phase_cpu_wait[self._index]
        return np.array([b.phase_cpu_wait or 0.0 for b in self.beats], np.float64)

    @cached_property
    def cpu_wait_total(self) -> Floats:
        """0 where the rank did not say."""
        if self._parent is not None:
            return self._parent.cpu_wait_total[self._index]
        return np.array([b.cpu_wait_total or 0.0 for b in self.beats], np.float64)

    @cached_property
    def compute_seconds(self) -> Floats:
        """0 where the rank did not say."""
        if self._parent is not None:
            return self._parent.compute_seconds[self._index]
        return np.array([b.compute_seconds or 0.0 for b in self.beats], np.float64)

    @cached_property
    def cpu_wait_seconds(self) -> Floats:
        """0 where the rank did not say."""
        if self._parent is not None:
            return self._parent.cpu_wait_seconds[self._index]
        return np.array([b.cpu_wait_seconds or 0.0 for b in self.beats], np.float64)

    @cached_property
    def compute_total(self) -> Floats:
        """NaN where the rank did not say (an older worker)."""
        if self._parent is not None:
            return self._parent.compute_total[self._index]
        return np.array([math.nan if b.compute_total is None else b.compute_total
                         for b in self.beats], np.float64)

    def __len__(self) -> int:
        return len(self.beats)

    def in_phase(self, *phases: str) -> Flags:
        """Return which rows are in one of ``phases``."""
        if len(phases) == 1:
            return self.phase == code_of(phases[0])
        return np.isin(self.phase, [code_of(p) for p in phases])

    def subset(self, which: Flags) -> RankColumns:
        """Return the columns of the rows ``which`` marks: the fields read here already
        are indexed, not read off the records again."""
        index = np.flatnonzero(which)
        child = RankColumns([self.beats[i] for i in index.tolist()], self.rank[index])
        child._parent, child._index = self, index
        return child

    def rows(self, which: Flags) -> list[Heartbeat]:
        """Return the records of the rows ``which`` marks, in row order."""
        beats = self.beats
        return [beats[i] for i in np.flatnonzero(which).tolist()]


class RankArrays:
    """Per-rank figures a rule keeps from poll to poll, in arrays indexed by rank, grown
    as higher ranks are heard; ``seen`` says which ranks have any."""

    def __init__(self, **fields: tuple[type, float | int]) -> None:
        self._fields = fields  # name -> (dtype, the value of a rank not seen)
        self.seen: Flags = np.zeros(0, np.bool_)
        self.arrays: dict[str, np.ndarray] = {
            name: np.full(0, fill, dtype) for name, (dtype, fill) in fields.items()}

    def fit(self, ranks: Ints) -> None:
        """Make room for every rank in ``ranks``."""
        size = int(ranks.max()) + 1 if len(ranks) else 0
        if size <= len(self.seen):
            return
        size = max(size, 2 * len(self.seen))
        grown = size - len(self.seen)
        self.seen = np.concatenate([self.seen, np.zeros(grown, np.bool_)])
        for name, (dtype, fill) in self._fields.items():
            self.arrays[name] = np.concatenate([self.arrays[name], np.full(grown, fill, dtype)])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]
