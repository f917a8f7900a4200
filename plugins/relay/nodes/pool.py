"""The node pool: which nodes exist, which are quarantined (why, until when), which to use.

A node chosen for an attempt is leased to its holder (the DAG run) until the
attempt ends or the lease expires, so two DAG runs never train on one node at
once; a task killed without cleaning up frees its nodes when its DAG run's next
attempt leases again, or after :data:`LEASE_SECONDS`.

State lives in a :mod:`relay.nodes.store`: by default one JSON file
(``$RELAY_HOME/nodes.json``) changed only under an exclusive ``flock``; with
``RELAY_NODE_POOL_URL`` one row of a database every Airflow worker reaches,
changed only in a transaction that locks it. Either way it survives Airflow
restarts and two segments deciding at once cannot lose each other's quarantines.
Simulated local nodes come from ``RELAY_NODES``; on Kubernetes the same
quarantine becomes a node taint.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relay.core.exceptions import NotEnoughNodesError
from relay.nodes.store import FileStore, PoolStore, from_settings

log = logging.getLogger(__name__)

DEFAULT_NODES = ("node-a", "node-b", "node-c", "node-d", "node-e")
LEASE_SECONDS = 6 * 3600.0


@dataclass(frozen=True)
class Quarantine:
    """Why a node is kept out, and until when."""

    node: str
    reason: str
    since: float
    until: float
    by: str

    def active(self, now: float) -> bool:
        """Return whether the quarantine still holds at ``now``."""
        return now < self.until


def lease_holder(dag_id: str, dag_run_id: str) -> str:
    """Return who holds a DAG run's node leases."""
    return f"{dag_id}/{dag_run_id}"


def inventory() -> list[str]:
    """Return the node names (``RELAY_NODES``, comma-separated; default node-a..node-e)."""
    raw = os.environ.get("RELAY_NODES")
    if not raw:
        return list(DEFAULT_NODES)
    return [n.strip() for n in raw.split(",") if n.strip()]


class NodePool:
    """Quarantine, release and select nodes; safe across processes."""

    def __init__(self, state_file: Path | None = None, nodes: list[str] | None = None,
                 store: PoolStore | None = None) -> None:
        """Use ``store``, else the file ``state_file``, else what the settings name
        (``RELAY_NODE_POOL_URL``, or ``$RELAY_HOME/nodes.json``)."""
        if store is None:
            store = FileStore(state_file) if state_file is not None else from_settings()
        self.store = store
        self.nodes = nodes if nodes is not None else inventory()

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """Yield the pool's state locked against every other decider; store it if changed."""
        with self.store.locked() as state:
            yield state

    def quarantines(self, now: float | None = None) -> dict[str, Quarantine]:
        """Return the quarantines in force at ``now``."""
        now = time.time() if now is None else now
        with self._locked() as state:
            found = {n: Quarantine(**q) for n, q in state["quarantines"].items()}
        return {n: q for n, q in found.items() if q.active(now)}

    def quarantine(self, node: str, seconds: float, reason: str, by: str) -> Quarantine:
        """Keep ``node`` out of every segment for ``seconds`` (an existing longer one stays)."""
        if node not in self.nodes:
            raise ValueError(f"node {node!r}: expected one of {self.nodes}")
        now = time.time()
        entry = Quarantine(node=node, reason=reason, since=now, until=now + seconds, by=by)
        with self._locked() as state:
            old = state["quarantines"].get(node)
            if old is None or old["until"] < entry.until:
                state["quarantines"][node] = asdict(entry)
            else:
                entry = Quarantine(**old)
        log.warning("Node %s quarantined until %s: %s", node, time.ctime(entry.until), reason)
        return entry

    def release(self, node: str) -> bool:
        """Lift a node's quarantine; return whether there was one."""
        with self._locked() as state:
            return state["quarantines"].pop(node, None) is not None

    def healthy(self, now: float | None = None) -> list[str]:
        """Return the nodes not in quarantine, in inventory order."""
        held = self.quarantines(now)
        return [n for n in self.nodes if n not in held]

    def leases(self, now: float | None = None) -> dict[str, dict[str, Any]]:
        """Return the leases in force at ``now``: node -> {holder, until}."""
        now = time.time() if now is None else now
        with self._locked() as state:
            return {n: dict(lease) for n, lease in state.get("leases", {}).items()
                    if lease.get("until", 0) > now}

    def available(self, holder: str | None = None, now: float | None = None) -> list[str]:
        """Return the healthy nodes not leased to anyone but ``holder``, in inventory order."""
        leased = {n for n, lease in self.leases(now).items() if lease.get("holder") != holder}
        return [n for n in self.healthy(now) if n not in leased]

    def next_lease(self, holder: str, count: int, leave_out: set[str] | None = None,
                   ) -> list[str] | None:
        """Return the nodes ``holder``'s next lease of ``count`` would pick unless the pool
        changes first (those whose agents to warm up), or None if too few are free."""
        free = [n for n in self.available(holder) if n not in (leave_out or set())]
        return free[:count] if len(free) >= count else None

    def _lease(self, count: int, holder: str, seconds: float,
               leave_out: frozenset[str] = frozenset()) -> list[str] | None:
        """Lease ``count`` free healthy nodes to ``holder`` in one locked step, or None."""
        now = time.time()
        with self._locked() as state:
            held = {n for n, q in state["quarantines"].items() if Quarantine(**q).active(now)}
            leases = {n: lease for n, lease in state["leases"].items()
                      if lease.get("until", 0) > now and lease.get("holder") != holder}
            free = [n for n in self.nodes
                    if n not in held and n not in leases and n not in leave_out]
            if len(free) < count:
                return None
            chosen = free[:count]
            # The holder's earlier leases (an attempt that ended without releasing) go.
            leases.update({n: {"holder": holder, "until": now + seconds} for n in chosen})
            state["leases"] = leases
            return chosen

    def release_lease(self, holder: str) -> list[str]:
        """End every lease of ``holder``; return the nodes freed."""
        with self._locked() as state:
            freed = [n for n, lease in state["leases"].items() if lease.get("holder") == holder]
            for node in freed:
                del state["leases"][node]
        return freed

    def select(self, count: int, wait_up_to: float = 0.0, poll_seconds: float = 2.0,
               holder: str | None = None, lease_seconds: float = LEASE_SECONDS,
               leave_out: frozenset[str] = frozenset()) -> list[str]:
        """Pick ``count`` healthy nodes, waiting up to ``wait_up_to`` for quarantines (and
        other holders' leases) to end; with a ``holder``, lease them to it. ``leave_out``:
        nodes not to pick this time although healthy (a preempted node, for one retry)."""
        deadline = time.monotonic() + wait_up_to
        while True:
            if holder is not None:
                chosen = self._lease(count, holder, lease_seconds, leave_out)
                if chosen is not None:
                    return chosen
            elif len(healthy := [n for n in self.healthy() if n not in leave_out]) >= count:
                return healthy[:count]
            if time.monotonic() >= deadline:
                raise NotEnoughNodesError(self._shortage(count, holder))
            time.sleep(min(poll_seconds, max(0.0, deadline - time.monotonic())))

    def _shortage(self, count: int, holder: str | None) -> str:
        """Say why ``count`` nodes could not be had, and what to do."""
        fmt = "%H:%M:%S"
        free = self.available(holder)
        held = "; ".join(
            f"{n} until {time.strftime(fmt, time.localtime(q.until))} ({q.reason})"
            for n, q in self.quarantines().items())
        leased = "; ".join(
            f"{n} to {lease['holder']} until {time.strftime(fmt, time.localtime(lease['until']))}"
            for n, lease in self.leases().items() if lease.get("holder") != holder)
        return (
            f"node pool: expected {count} healthy nodes, found {len(free)} "
            f"({', '.join(free) or 'none'}); quarantined: {held or 'none'}; in use by other "
            f"DAG runs: {leased or 'none'}. Release a node with `relay nodes release NODE`, add "
            "nodes to RELAY_NODES, or wait for a quarantine to expire or another run to finish."
        )
