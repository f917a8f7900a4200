"""The local launcher's warm starts: agents preloaded before an attempt needs them.

A resident agent per DAG run (:mod:`relay_train.agent.resident`) preloads the
training stack once, at a low CPU priority, and forks standbys on request; a
standby (:mod:`relay_train.agent.standby`) waits preloaded in a segment's standby
folder (:data:`~relay.launchers.local.warm_agents.STANDBY_DIR`) until a launch
takes it. :meth:`LocalWarmStart.warm_standbys` warms the retry's agents while a faulty
attempt is stopped (copies of its agents that still answer first), and
:meth:`LocalWarmStart.reside` keeps the run's resident.
"""

from __future__ import annotations

import logging
from pathlib import Path

from relay.core.attempt import Attempt
from relay.launchers.agent_client import AgentChannel
from relay.launchers.local import prestart as local_prestart
from relay.launchers.local.warm_agents import (
    LINGER_SECONDS,
    from_resident,
    live_resident,
    record,
    recorded_pid,
    release,
    start_recorded,
    take_standby,
)
from relay_train.agent.resident import RESIDENT_DIR
from relay_train.protocol.routes import (
    DIRECTORY,
    LINGER,
    MAX_STANDBY_TTL_SECONDS,
    PID,
    STANDBY_TTL_SECONDS,
    TTL,
    Route,
)

log = logging.getLogger(__name__)
STANDBY_ASK_TIMEOUT_SECONDS = 1.5  # a fork answers within the agent's own 1 s wait


class LocalWarmStart:
    """The warm starts of :class:`relay.launchers.local.launcher.LocalLauncher`, which
    provides the channel to an attempt's agents (``channel``)."""

    def channel(self, attempt: Attempt) -> AgentChannel:
        """Return the channel to the attempt's agents."""
        raise NotImplementedError

    def warm_standbys(
        self, directory: Path, nodes: list[str], ttl_seconds: float = STANDBY_TTL_SECONDS,
        source: Attempt | None = None,
    ) -> None:
        """Have a standby agent wait preloaded on each node, for a launch being prepared.

        A node of the ``source`` attempt whose agent answers gets a copy of that agent
        (forked, preloaded already), any other node one forked by the run's resident
        agent, or else a new process that preloads.
        """
        directory.mkdir(parents=True, exist_ok=True)
        for node in nodes:
            if recorded_pid(directory, node) is not None:
                continue
            pid = self._fork_standby(source, node, directory, ttl_seconds) if source else None
            if pid is not None:
                record(directory, node, pid)
                log.info("Standby agent for %s: pid %d, forked from the agent of the faulty "
                         "attempt (preloaded)", node, pid)
            elif self._resident_standby(directory, node, ttl_seconds) is None:
                pid = start_recorded(
                    ["relay_train.agent.node", "--standby", str(directory), "--node", node,
                     "--ttl", str(ttl_seconds), "--linger", str(LINGER_SECONDS)],
                    directory, node)
                log.info("Standby agent for %s: pid %d, started", node, pid)

    def reside(self, run_dir: Path, nodes: list[str], prestarted: Path | None = None) -> None:
        """Start a resident agent (:mod:`relay_train.agent.resident`) for ``nodes``, so that a
        launch or a retry onto one of them gets a standby forked, preloaded, instead of a
        new interpreter.

        One per DAG run, on the first of ``nodes``: this launcher's nodes share one host,
        so that resident forks the standbys of any of them (preflight starts it for the
        first segment's), and a second would import the same stack again on the CPUs the
        ranks train on. A live ``prestarted`` one (:mod:`relay.launchers.local.prestart`)
        becomes the run's instead."""
        if prestarted is not None and local_prestart.take(run_dir, prestarted):
            log.info("Resident agent for this host's nodes: the one prestarted beside "
                     "Airflow's start-up (%s)", prestarted)
            return
        directory = run_dir / RESIDENT_DIR
        directory.mkdir(parents=True, exist_ok=True)
        if nodes and live_resident(directory) is None:
            pid = start_recorded(["relay_train.agent.resident", "--dir", str(directory),
                                   "--node", nodes[0]], directory, nodes[0])
            log.info("Resident agent for %s (and this host's other nodes): pid %d",
                     nodes[0], pid)

    def _from_resident(self, directory: Path, nodes: list[str]) -> None:
        """Have the run's resident agent fork a standby into ``directory`` for each of
        ``nodes`` that has none there (nothing without a resident)."""
        for node in nodes:
            if recorded_pid(directory, node) is None and \
                    self._resident_standby(directory, node, STANDBY_TTL_SECONDS) is None:
                return  # no resident, or it does not answer: new agents, the slow way

    @staticmethod
    def _resident_standby(directory: Path, node: str, ttl_seconds: float) -> int | None:
        """Have the run's resident agent fork ``node``'s standby into ``directory`` and
        record it; return its PID (None: no resident, or it did not answer)."""
        pid = from_resident(directory, node, ttl_seconds)
        if pid is not None:
            directory.mkdir(parents=True, exist_ok=True)
            record(directory, node, pid)
            log.info("Standby agent for %s: pid %d, forked from the run's resident agent "
                     "(preloaded)", node, pid)
        return pid

    def _fork_standby(self, source: Attempt, node: str, directory: Path,
                      ttl_seconds: float) -> int | None:
        """Ask ``source``'s agent on ``node`` to fork a standby; return its PID if it did."""
        channel = self.channel(source)
        if node not in channel.addresses or node in channel.silent:
            return None
        reply = channel.call_quietly(node, Route.STANDBY, STANDBY_ASK_TIMEOUT_SECONDS,
                                     **{DIRECTORY: str(directory),
                                        TTL: min(ttl_seconds, MAX_STANDBY_TTL_SECONDS),
                                        LINGER: LINGER_SECONDS})
        pid = (reply or {}).get(PID)
        return pid if isinstance(pid, int) and pid > 0 else None

    _take = staticmethod(take_standby)
    release_standbys = staticmethod(release)
