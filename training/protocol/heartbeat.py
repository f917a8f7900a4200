"""The heartbeat record: the one contract between the worker side and Relay.

Imports neither torch nor Airflow. A rank keeps a :class:`HeartbeatWriter`;
its training loop only updates fields in memory (``beat``/``enter``), and a
background thread writes the record atomically (temp file + ``os.replace``)
every ``interval_seconds``. Watchers read records with :func:`read_heartbeats`.
The environment variables that tell a rank where to write them are named in
:mod:`relay_train.protocol.env`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path

from relay_train.protocol.env import ENV_CLOCK_SKEW, ENV_NODE
from relay_train.protocol.pids import start_time

log = logging.getLogger(__name__)

HEARTBEAT_GLOB = "rank-*.json"


def clock_skew(node: str | None = None) -> float:
    """Return the test-only skew of ``node``'s clock from :data:`ENV_CLOCK_SKEW` (0: none)."""
    raw = os.environ.get(ENV_CLOCK_SKEW, "").strip()
    if not raw:
        return 0.0
    if "=" not in raw:
        return float(raw)
    pairs = dict(part.split("=", 1) for part in raw.split(",") if "=" in part)
    return float(pairs.get(node or os.environ.get(ENV_NODE, ""), 0.0))


def node_clock() -> float:
    """Return this node's wall clock (``time.time()``, shifted only by the test hook)."""
    return time.time() + clock_skew()


class Phase(StrEnum):
    """Where a rank is inside its step."""

    STARTING = "starting"
    COMPUTE = "compute"
    COLLECTIVE = "collective"
    CHECKPOINT = "checkpoint"
    DONE = "done"


@dataclass
class Heartbeat:
    """One rank's state as last written."""

    rank: int
    node: str
    pid: int
    pid_started: int | None = None  # the rank's start time (protocol.pids): who may signal it
    step: int = 0
    phase: str = Phase.STARTING.value
    phase_started_at: float = field(default_factory=node_clock)
    compute_seconds: float | None = None  # per step, smoothed (an EWMA)
    compute_total: float | None = None  # every step's compute added up: the exact figure
    samples_per_second: float | None = None
    # Of compute_seconds (and of compute_total), the time the rank's thread was ready but
    # waited for a CPU (relay_train.cpu_wait): the host's load, not the rank's work.
    cpu_wait_seconds: float | None = None
    cpu_wait_total: float | None = None
    step_seconds: float | None = None  # wall time per step, smoothed
    phase_cpu_wait: float | None = None  # of the phase so far (at wall_clock), waited for a CPU
    loss: float | None = None
    nonfinite_step: int | None = None  # the first step whose loss was NaN/inf, once seen
    wall_clock: float = field(default_factory=node_clock)
    seq: int = 0

    @classmethod
    def from_json(cls, text: str) -> Heartbeat:
        """Parse a record written by :meth:`to_json`, ignoring unknown keys."""
        return cls.from_record(json.loads(text))

    @classmethod
    def from_record(cls, raw: object) -> Heartbeat:
        """Build a record from its parsed JSON object, ignoring unknown keys."""
        if not isinstance(raw, dict):
            raise ValueError("a heartbeat record is a JSON object")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)

    def to_json(self) -> str:
        """Serialise the record."""
        return json.dumps(asdict(self), separators=(",", ":"))


def heartbeat_path(directory: Path, rank: int) -> Path:
    """Return where rank ``rank`` writes its heartbeat."""
    return directory / f"rank-{rank}.json"


def write_atomically(path: Path, text: str, *, durable: bool = False) -> None:
    """Write ``text`` to ``path`` so that readers never see a partial file.

    The temporary file has a unique name (two writers, even threads of one process,
    never share it). ``durable`` also fsyncs the file and its folder, so state that
    must survive a power cut (the node pool, decisions) is on disk once this returns.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def read_heartbeats(directory: Path) -> dict[int, Heartbeat]:
    """Read every rank's latest record in ``directory``; skip unreadable files."""
    beats: dict[int, Heartbeat] = {}
    if not directory.is_dir():
        return beats
    for path in directory.glob(HEARTBEAT_GLOB):
        try:
            beat = Heartbeat.from_json(path.read_text())
            if not isinstance(beat.rank, int) or not isinstance(beat.step, int):
                raise TypeError("rank and step must be whole numbers")
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            # A record being replaced or half-written by a dying process is
            # not evidence of anything; the next poll will see it again.
            log.debug("Skipping unreadable heartbeat %s: %s", path, exc)
            continue
        beats[beat.rank] = beat
    return beats


class HeartbeatWriter:
    """Keep one rank's record in memory and write it from a daemon thread."""

    def __init__(
        self, directory: Path, rank: int, node: str, interval_seconds: float, step: int = 0
    ) -> None:
        self._path = heartbeat_path(directory, rank)
        directory.mkdir(parents=True, exist_ok=True)
        self._beat = Heartbeat(rank=rank, node=node, pid=os.getpid(),
                               pid_started=start_time(os.getpid()), step=step)
        self._lock = threading.Lock()
        self._interval = interval_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)
        self._cpu_wait: Callable[[], float | None] | None = None  # the training thread's
        self._phase_wait: float | None = None  # its CPU wait when the phase began
        self._after_write: Callable[[], None] | None = None

    def watch_cpu_wait(self, waited: Callable[[], float | None]) -> None:
        """Say how to read the training thread's CPU wait so far (relay_train.cpu_wait):
        each record then says how much of its phase so far was a wait for a CPU."""
        self._cpu_wait = waited

    def after_each_write(self, call: Callable[[], None]) -> None:
        """Run ``call`` in the writer's thread after each periodic write (rank 0 sends the
        metrics a stalled loop holds back from there: relay_train.metrics)."""
        self._after_write = call

    @property
    def enabled(self) -> bool:
        """Return whether records are written (an interval <= 0 turns them off)."""
        return self._interval > 0

    def start(self) -> HeartbeatWriter:
        """Write the first record now and start the background thread."""
        if not self.enabled:
            return self
        self._flush()
        self._thread.start()
        return self

    @property
    def phase_began_waited(self) -> float | None:
        """Return the training thread's CPU wait when the current phase began (None:
        unknown): read once at each phase change, for the step's figures too."""
        return self._phase_wait

    def enter(self, phase: Phase) -> None:
        """Mark the start of ``phase`` (cheap: memory, and the CPU wait when watched)."""
        waited = self._cpu_wait() if self._cpu_wait is not None else None
        with self._lock:
            self._beat.phase = phase.value
            self._beat.phase_started_at = node_clock()
            self._phase_wait = waited
            self._beat.phase_cpu_wait = None if waited is None else 0.0

    def beat(
        self,
        *,
        step: int,
        compute_seconds: float | None = None,
        samples_per_second: float | None = None,
        loss: float | None = None,
        compute_total: float | None = None,
        step_seconds: float | None = None,
        cpu_wait: tuple[float, float] | None = None,
    ) -> None:
        """Record a finished step (cheap: memory only). ``cpu_wait``: the CPU wait of its
        compute (smoothed) and every step's added up."""
        with self._lock:
            self._beat.step = step
            if step_seconds is not None:
                self._beat.step_seconds = step_seconds
            if cpu_wait is not None:
                self._beat.cpu_wait_seconds, self._beat.cpu_wait_total = cpu_wait
            if compute_seconds is not None:
                self._beat.compute_seconds = compute_seconds
            if compute_total is not None:
                self._beat.compute_total = compute_total
            if samples_per_second is not None:
                self._beat.samples_per_second = samples_per_second
            if loss is not None:
                self._beat.loss = loss
                if self._beat.nonfinite_step is None and not math.isfinite(loss):
                    self._beat.nonfinite_step = step

    def flush_now(self) -> None:
        """Write the record at once (for news that cannot wait for the next interval)."""
        if self.enabled:
            self._flush()

    def close(self) -> None:
        """Mark the rank done, write a last record and stop the thread."""
        self.enter(Phase.DONE)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self._interval + 1)
        if self.enabled:
            self._flush()

    def _flush(self) -> None:
        waited = self._cpu_wait() if self._cpu_wait is not None else None
        with self._lock:
            if waited is not None and self._phase_wait is not None:
                self._beat.phase_cpu_wait = max(waited - self._phase_wait, 0.0)
            self._beat.wall_clock = node_clock()
            self._beat.seq += 1
            text = self._beat.to_json()
        try:
            write_atomically(self._path, text)
        except OSError as exc:
            # Losing one beat is harmless; crashing the rank over it is not.
            log.warning("Could not write heartbeat %s: %s", self._path, exc)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._flush()
            if self._after_write is not None:
                try:
                    self._after_write()
                except Exception:  # noqa: BLE001 - the records go on whatever it does
                    log.exception("The heartbeat writer's after-write call failed")
