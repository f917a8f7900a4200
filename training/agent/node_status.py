"""What a node agent says about itself over the channel: its state, the PIDs of its
process group and ranks, their exit codes, the failed ranks' last log lines, its
clock and rank 0's first step (heartbeats and boundaries are added by the server
from :mod:`relay_train.agent.node_files`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from relay_train.agent.notice import Notice
from relay_train.agent.ranks import RankProcess, log_tail, rank_log
from relay_train.protocol.heartbeat import node_clock
from relay_train.protocol.injection import CHAOS_LOG, CHAOS_SENT
from relay_train.protocol.launch import FIRST_STEP_FILE, LaunchConfig
from relay_train.protocol.routes import (
    AGENT_CLOCK,
    AGENT_PID,
    CHAOS,
    ERRORS,
    EXIT_CODES,
    FIRST_STEP,
    PGID,
    PREEMPTED,
    RANK_PIDS,
    STATE,
    NodeState,
)


class NodeStatus:
    """The status record of :class:`~relay_train.agent.node.NodeAgent` (a mixin: the agent
    sets these attributes)."""

    cfg: LaunchConfig
    procs: dict[int, RankProcess]
    state: NodeState
    notice: Notice | None  # the platform's preemption notice, once a SIGTERM came
    _error_tails: dict[int, str]  # rank -> the last lines of its log, read once
    _first: dict[str, Any] | None  # rank 0's first-step record, read once
    _chaos: tuple[int, list[dict[str, Any]]]  # chaos.jsonl's size when read, its records

    def status_record(self) -> dict[str, Any]:
        """Return this node's state for the channel: state, PIDs, exit codes, errors."""
        procs = dict(self.procs)
        notice = self.notice
        return {
            **({PREEMPTED: notice.record()} if notice is not None else {}),
            STATE: self.state,
            AGENT_PID: os.getpid(),
            PGID: os.getpgid(0),
            RANK_PIDS: {str(r): p.pid for r, p in procs.items()},
            EXIT_CODES: {str(r): p.exitcode for r, p in procs.items()},
            ERRORS: self._errors(procs),
            AGENT_CLOCK: node_clock(),
            FIRST_STEP: self._first_step(),
            **({CHAOS: strikes} if (strikes := self._strikes()) else {}),
        }

    def _strikes(self) -> list[dict[str, Any]]:
        """Return the faults injected on this node so far (its ranks' ``chaos.jsonl``): an
        injected fault's onset, for Relay's figures, when Relay does not share this disk."""
        path = self.cfg.root / CHAOS_LOG
        try:
            size = path.stat().st_size
        except OSError:
            return []
        if size != self._chaos[0]:
            lines = path.read_text().splitlines()
            found = []
            for line in lines:
                try:
                    found.append(json.loads(line))
                except ValueError:  # a rank is writing it: read again at the next ask
                    size = -1
            self._chaos = (size, found)
            if found:  # the rank of a stop_node waits for this before it freezes the node
                (self.cfg.root / CHAOS_SENT).write_text(str(len(found)))
        return self._chaos[1]

    def _first_step(self) -> dict[str, Any] | None:
        """Return rank 0's first-step record if it runs here and wrote it (the time to
        resume's last mark: Relay may not share this node's disk)."""
        if self._first is None:
            try:
                self._first = json.loads((self.cfg.root / FIRST_STEP_FILE).read_text())
            except (OSError, ValueError):
                return None
        return self._first

    def _errors(self, procs: dict[int, RankProcess]) -> dict[str, str]:
        """Return the last lines of each failed rank's log: the script's own error."""
        errors = {}
        for rank, proc in procs.items():
            if proc.exitcode not in (None, 0):
                if rank not in self._error_tails:
                    self._error_tails[rank] = log_tail(rank_log(self.cfg, rank))
                errors[str(rank)] = self._error_tails[rank]
        return errors
