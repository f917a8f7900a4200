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
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import Any

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


class _Field:
    """One field of :class:`RankColumns`: read off every record the first time a rule asks
    for it (in a subset, indexed from its parent's), then kept on the columns.
    ``missing`` stands for a None; ``convert`` maps the values read."""

    def __init__(self, dtype: type, missing: float | None = None,
                 convert: Callable[[list[Any]], list[Any]] | None = None) -> None:
        self.dtype, self.missing, self.convert = dtype, missing, convert
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, cols: RankColumns | None, owner: type) -> Any:  # noqa: ANN401
        if cols is None:
            return self
        if cols._parent is not None:  # noqa: SLF001 - the columns' own
            value = getattr(cols._parent, self.name)[cols._index]  # noqa: SLF001
        else:
            values = list(map(attrgetter(self.name), cols.beats))
            if self.missing is not None:
                missing = self.missing
                values = [missing if v is None else v for v in values]
            if self.convert is not None:
                values = self.convert(values)
            value = np.array(values, self.dtype)
        cols.__dict__[self.name] = value  # (a non-data descriptor: found there from now on)
        return value


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

    step = _Field(np.int64)
    phase = _Field(np.int8, convert=lambda phases: [  # PHASE_CODES, else UNKNOWN_PHASE
        PHASE_CODES.get(p, UNKNOWN_PHASE) for p in phases])
    wall_clock = _Field(np.float64)
    phase_started_at = _Field(np.float64)
    phase_cpu_wait = _Field(np.float64, missing=0.0)  # 0 where the rank did not say
    cpu_wait_total = _Field(np.float64, missing=0.0)
    compute_seconds = _Field(np.float64, missing=0.0)
    cpu_wait_seconds = _Field(np.float64, missing=0.0)
    compute_total = _Field(np.float64, missing=math.nan)  # NaN: not said (an older worker)

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

    def by_rank(self, *names: str, where: Flags | None = None) -> dict[int, Any]:
        """Return rank -> its figures ``names`` (a tuple; the figure, for one name), for
        every rank seen (and marked by ``where``): what a rule kept, for its tests."""
        ranks = np.flatnonzero(self.seen if where is None else self.seen & where)
        columns = [self.arrays[n][ranks].tolist() for n in names]
        figures = columns[0] if len(names) == 1 else list(zip(*columns, strict=True))
        return dict(zip(ranks.tolist(), figures, strict=True))
