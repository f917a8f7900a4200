"""Fault injection from inside a rank, for tests, demos and benchmarks.

What a fault is (its kinds, targets and fields, as a DAG run's conf gives it) is
the protocol's: :class:`~relay_train.protocol.injection.InjectedFault`. This is
how a rank applies the faults planned for it (:class:`ChaosMonkey`), as its
steps go by, and records each strike in the attempt's ``chaos.jsonl``.

A ``once`` fault: the first rank to strike leaves a marker two folders up from
the attempt folder (the DAG run's folder), which later attempts see. A lasting
fault with ``once: true`` is a property of a *node*: the first time the job
reaches ``step``, the node then hosting ``rank`` turns slow and stays slow, so
every rank on that node, in this attempt and every later one, is struck from
then on (a job that moves away from the node leaves it behind; one that stays
keeps paying).

``stop_node`` freezes every process of the node: under Relay's node agent that
is the rank's process group; under torchrun (whose ranks each get a session of
their own) ``relay_train.baselines.torchrun_worker`` sets ``RELAY_NODE_AGENT_PID``, and the
agent and all its children are frozen too.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from relay_train.protocol.env import ENV_NODE_AGENT_PID
from relay_train.protocol.injection import CHAOS_LOG, CHAOS_SENT, LASTING, InjectedFault
from relay_train.protocol.pids import signal_group, signal_process, start_time

log = logging.getLogger(__name__)

# A stop_node that must be announced (``announce``) strikes this long after it is recorded:
# time for the node's agent to carry the strike to Relay before it is frozen itself.
ANNOUNCE_SECONDS = 1.5

def chaos_hang_forever() -> None:
    """Stay alive (heartbeats keep coming) but never finish the step.

    Its own function, so that a hang's evidence names it: the culprit's stack ends here.
    """
    while True:
        time.sleep(3600)


class ChaosMonkey:
    """Apply the faults planned for this rank as its steps go by."""

    def __init__(
        self,
        faults: list[dict[str, Any]],
        *,
        segment: int,
        attempt: int,
        rank: int,
        node: str,
        record_dir: Path | None = None,
        announce: bool = False,
    ) -> None:
        where = {"segment": segment, "attempt": attempt, "rank": rank, "node": node}
        # Relay cannot read this node's chaos.jsonl (a host or pod of its own): its agent
        # sends the strikes over the channel, so a stop_node waits for that before freezing.
        self._announce = announce
        self._planned = [InjectedFault.from_dict(raw) for raw in faults]
        self._faults = [f for f in self._planned if f.targets(**where) or _node_bound(f)]
        self._where = where
        self._record_dir = record_dir
        self._struck: set[int] = set()
        self._markers = record_dir.parent.parent / "chaos-once" if record_dir else None
        self._rng = random.Random(f"{segment}-{attempt}-{rank}")  # never the training RNG
        self._slow_nodes: dict[int, str] = {}  # node-bound faults: the node each one struck

    def move_to(self, segment: int, attempt: int) -> None:
        """Follow a workload that trains on into a later segment (relay_train.boundary).

        Faults struck so far stay struck; the rest are chosen again for the new place.
        """
        struck = [self._faults[i] for i in self._struck]
        slow = {id(self._faults[i]): node for i, node in self._slow_nodes.items()}
        self._where = {**self._where, "segment": segment, "attempt": attempt}
        kept = [f for f in self._planned if f.targets(**self._where) or _node_bound(f)]
        self._faults = kept + [f for f in struck if all(f is not k for k in kept)]
        self._struck = {i for i, f in enumerate(self._faults) if any(f is s for s in struck)}
        self._slow_nodes = {i: slow[id(f)] for i, f in enumerate(self._faults) if id(f) in slow}

    def _due(self, step: int, kinds: tuple[str, ...]) -> list[tuple[int, InjectedFault]]:
        return [
            (i, f) for i, f in enumerate(self._faults)
            if f.kind in kinds and (
                self._on_struck_node(i, f, step) if _node_bound(f)
                else f.strikes(step=step, **self._where) and self._first_time(i, f)
            )
        ]

    def _marker(self, fault: InjectedFault) -> Path | None:
        if self._markers is None:
            return None
        return self._markers / f"{fault.kind}-{fault.step}-{fault.rank}-{fault.node}"

    def _on_struck_node(self, index: int, fault: InjectedFault, step: int) -> bool:
        """Return whether a node-bound fault holds on this rank's node now."""
        node = self._slow_nodes.get(index)
        marker = self._marker(fault)
        if node is None and marker is not None and marker.exists():
            node = self._slow_nodes[index] = marker.read_text()
        if node is None and fault.strikes(step=step, **self._where):
            node = self._where["node"]
            if marker is not None:  # first writer wins; written whole, then linked in place
                marker.parent.mkdir(parents=True, exist_ok=True)
                draft = marker.with_name(f"{marker.name}.{os.getpid()}")
                draft.write_text(node)
                try:
                    os.link(draft, marker)
                except FileExistsError:
                    node = marker.read_text()
                finally:
                    draft.unlink()
            self._slow_nodes[index] = node
        return node == self._where["node"]

    def _first_time(self, index: int, fault: InjectedFault) -> bool:
        """Return False for a ``once`` fault that an earlier attempt already struck."""
        marker = self._marker(fault)
        if not fault.once or marker is None or index in self._struck:
            return True
        marker.parent.mkdir(parents=True, exist_ok=True)
        attempt = str(self._where["attempt"])
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            # Another rank of this same attempt may have struck it a moment ago.
            return marker.read_text() == attempt
        with os.fdopen(fd, "w") as fh:
            fh.write(attempt)
        return True

    def _record(self, index: int, fault: InjectedFault, step: int,
                at: float | None = None) -> None:
        if index in self._struck:
            return
        self._struck.add(index)
        log.warning("CHAOS: injecting %s at step %d (%s)", fault.kind, step, self._where)
        if self._record_dir is not None:
            entry = {**asdict(fault), **self._where, "step": step, "at": at or time.time(),
                     "pid": os.getpid()}
            with (self._record_dir / CHAOS_LOG).open("a") as fh:
                fh.write(json.dumps(entry) + "\n")

    def _await_announced(self, strikes_at: float) -> None:
        """Wait until the node's agent has sent every strike recorded here, or until
        ``strikes_at`` (then strike anyway: the onset stays unknown to Relay), then until
        ``strikes_at``: the recorded onset is the moment the node freezes."""
        folder = self._record_dir or Path(".")
        recorded = len((folder / CHAOS_LOG).read_text().splitlines())
        while time.time() < strikes_at:
            try:
                if int((folder / CHAOS_SENT).read_text() or 0) >= recorded:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        time.sleep(max(0.0, strikes_at - time.time()))

    def at_startup(self) -> None:
        """Never start, if a launch failure is planned (the process stays alive, silent)."""
        for index, fault in enumerate(self._faults):
            if fault.kind == "launch_failure":
                self._record(index, fault, -1)
                while True:
                    time.sleep(3600)

    def before_step(self, step: int) -> None:
        """Strike the one-shot process faults planned for ``step``."""
        for index, fault in self._due(step, ("crash", "stop_rank", "stop_node", "preempt")):
            if fault.kind == "stop_node" and self._announce and self._record_dir is not None:
                strikes_at = time.time() + ANNOUNCE_SECONDS
                self._record(index, fault, step, at=strikes_at)
                self._await_announced(strikes_at)
            else:
                self._record(index, fault, step)
            if fault.kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "stop_rank":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == "preempt":
                _notify_agent()
            else:
                _freeze_node()

    def delay(self, step: int, compute_estimate: float) -> float:
        """Spend the extra compute time planned for ``step``; return it (a hang never returns).

        ``compute_estimate`` must be the rank's own compute time without injected
        delays, or a straggler's delay would feed on itself and grow without end.
        """
        extra = 0.0
        for index, fault in self._due(step, ("hang", "straggler", "jitter", "pace")):
            self._record(index, fault, step)
            if fault.kind == "hang":
                chaos_hang_forever()
            elif fault.kind == "straggler":
                extra += max(fault.factor - 1.0, 0.0) * compute_estimate
            elif fault.kind == "pace":
                extra += fault.seconds
            else:
                extra += self._rng.uniform(0.0, fault.seconds)
        if extra > 0:
            time.sleep(extra)
        return extra

    def corrupt_loss(self, step: int, loss: Any) -> Any:  # noqa: ANN401 - a torch scalar
        """Return the loss, made NaN if planned for ``step``."""
        for index, fault in self._due(step, ("nan",)):
            self._record(index, fault, step)
            return loss * math.nan
        return loss


def _node_bound(fault: InjectedFault) -> bool:
    return fault.once and fault.kind in LASTING


def child_pids() -> dict[int, list[int]]:
    """Return the PIDs of every process's children, by parent PID (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def _notify_agent() -> None:
    """SIGTERM this rank's node agent (a preemption notice), while it is still its parent."""
    agent = int(os.environ.get(ENV_NODE_AGENT_PID) or os.getppid())
    if agent == os.getppid() and agent > 1:
        signal_process(agent, start_time(agent), signal.SIGTERM)


def _freeze_node() -> None:
    """SIGSTOP every process of this rank's node: its agent, its ranks, this rank last."""
    own = os.getpgid(0)
    agent = os.environ.get(ENV_NODE_AGENT_PID)
    groups: set[int] = set()
    # Only while the agent is still this rank's parent: a PID from the environment may
    # name another process once the agent has exited (this rank is then reparented).
    if agent and int(agent) == os.getppid():
        pids = [int(agent), *child_pids().get(int(agent), [])]
        for pid in pids:
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue
    for group in groups - {own}:
        signal_group(group, start_time(group), signal.SIGSTOP)  # found just now in /proc
    os.killpg(own, signal.SIGSTOP)  # this rank's own group
