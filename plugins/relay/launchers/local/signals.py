"""Fault injection on a local attempt's processes (:mod:`relay.tools.chaos`): signal a node's
process group or one rank, or throttle a rank, only while the PID recorded is still the
process it was (:mod:`relay_train.protocol.pids`)."""

from __future__ import annotations

import signal
import time
from typing import Any

from relay.core.attempt import Attempt
from relay.core.exceptions import NotOursError
from relay_train.protocol import pids


class LocalSignals:
    """The chaos hooks of :class:`relay.launchers.local.launcher.LocalLauncher`, which provides the
    attempt's handle (``_handle``) and the ranks' heartbeats (``heartbeats``)."""

    def _handle(self, attempt: Attempt) -> dict[str, dict[str, int | None]]:
        raise NotImplementedError

    def heartbeats(self, attempt: Attempt) -> dict[int, Any]:
        """Return the ranks' latest heartbeats (on Relay's clock)."""
        raise NotImplementedError

    def signal_node(self, attempt: Attempt, node: str, sig: signal.Signals) -> int:
        """Send ``sig`` to every process of ``node`` (its agent and its ranks); return the PGID.

        Raise KeyError for a node the attempt does not have, and :class:`NotOursError`
        when the group's recorded leader PID now belongs to another process.
        """
        handle = self._handle(attempt)
        if node not in handle:
            raise KeyError(f"node {node!r}: expected one of {sorted(handle)} in {attempt}")
        pgid = handle[node]["pgid"]
        if not pids.signal_group(pgid, handle[node]["started"], sig):
            raise NotOursError(f"node {node!r} (process group {pgid})")
        return pgid

    def _rank(self, attempt: Attempt, rank: int) -> tuple[int, int | None] | None:
        """Return a rank's PID and start time from its heartbeat (None before its first one)."""
        beat = self.heartbeats(attempt).get(rank)
        return None if beat is None else (beat.pid, beat.pid_started)

    def rank_pid(self, attempt: Attempt, rank: int) -> int | None:
        """Return the PID a rank reported in its heartbeat (None before its first one).

        Raise :class:`NotOursError` if that PID is no longer the rank's process.
        """
        found = self._rank(attempt, rank)
        if found is None:
            return None
        if not pids.is_same_process(*found):
            raise NotOursError(f"rank {rank} (pid {found[0]})")
        return found[0]

    def _rank_or_raise(self, attempt: Attempt, rank: int) -> tuple[int, int | None]:
        found = self._rank(attempt, rank)
        if found is None:
            raise KeyError(f"rank {rank}: no heartbeat from its node's agent for {attempt} yet")
        return found

    def signal_rank(self, attempt: Attempt, rank: int, sig: signal.Signals) -> int:
        """Send ``sig`` to one rank (by the PID in its heartbeat, if still its); return the PID."""
        pid, started = self._rank_or_raise(attempt, rank)
        if not pids.signal_process(pid, started, sig):
            raise NotOursError(f"rank {rank} (pid {pid})")
        return pid

    def throttle_rank(self, attempt: Attempt, rank: int, running: float, period: float,
                      seconds: float) -> bool:
        """Freeze a rank for ``1 - running`` of every ``period`` for ``seconds``.

        Return False if the rank ended meanwhile (its PID is then never signalled again).
        """
        pid, started = self._rank_or_raise(attempt, rank)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                if not pids.signal_process(pid, started, signal.SIGSTOP):
                    return False
                time.sleep(period * (1 - running))
                pids.signal_process(pid, started, signal.SIGCONT)
                time.sleep(period * running)
        finally:
            pids.signal_process(pid, started, signal.SIGCONT)
        return True
