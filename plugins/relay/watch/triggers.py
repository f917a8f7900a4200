"""The watchers: async triggers that run in Airflow's triggerer.

They gather observations without blocking (the launcher's channel to the node
agents is asked off the event loop, in a thread),
ask :class:`~relay.watch.detection.Detector` what they mean, and fire exactly one
event: ``completed``, ``fault`` (kind, culprit, evidence, detection time), or
``error`` (the watcher itself broke, with the traceback). Nothing they keep
matters across restarts, so running one twice is harmless.
"""

from __future__ import annotations

import asyncio
import math
import time
import traceback
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from relay.core.attempt import Attempt, AttemptState
from relay.core.faults import Fault, FaultKind
from relay.launchers import Launcher, launcher_from
from relay.policy.model import Detection
from relay.recover.warden import start_warden
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay.watch.warmer import Warmer, silent_nodes
from relay_train.protocol.heartbeat import Phase, read_heartbeats
from relay_train.protocol.run_lease import RUN_LEASE_SECONDS


def observe_attempt(
    attempt_dir: Path, node_ranks: dict[str, list[int]], heartbeat_interval: float,
    launcher: Launcher | None = None,
) -> Observation:
    """Ask the attempt's node agents for one snapshot (blocking network I/O).

    Heartbeats come over the launcher's channel, already on Relay's clock; no file
    of the attempt folder is read (the local launcher reads its own launch record).
    """
    launcher = launcher or launcher_from(None)
    status = launcher.status(Attempt(attempt_dir))
    try:
        launched_at = launcher.started_at(Attempt(attempt_dir))
    except (OSError, ValueError, KeyError):
        launched_at = time.time()
    return Observation(
        now=time.time(),
        launched_at=launched_at,
        heartbeats=status.heartbeats,
        node_ranks=node_ranks,
        heartbeat_interval=heartbeat_interval,
        launch=status,
    )


class WatchEvent(TriggerEvent):
    """A watcher's event. Airflow's triggerer logs every event at INFO, into the task's log,
    by its repr: this one says what happened in a few words, never the launch record it
    carries back to the task (``execute_complete`` gets the whole payload)."""

    def __repr__(self) -> str:
        payload = self.payload if isinstance(self.payload, dict) else {}
        what = ""
        if isinstance(payload.get("fault"), dict):
            try:
                fault = Fault.from_event(payload["fault"])
                what = f": {fault.kind.value} ({fault.culprit})"
            except (TypeError, ValueError):
                what = ": a fault"
        elif payload.get("message"):
            what = f": {str(payload['message'])[:200]}"
        return f"WatchEvent<{payload.get('status')}{what}>"


def _error_event(where: str, exc: BaseException) -> TriggerEvent:
    return WatchEvent(
        {
            "status": AttemptState.FAILED.value,
            "attempt_dir": where,
            "message": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    )


# Every rank's loop has ended (its last heartbeat says done): only the exits are left to see,
# which a short poll sees sooner. For a while only: a rank stuck on its way out is a hang.
FINISHING_POLL_SECONDS = 0.1
FINISHING_FOR_SECONDS = 5.0


def finishing(obs: Observation) -> bool:
    """Return whether every rank has left its training loop (its last heartbeat: done)."""
    return all(r in obs.heartbeats and obs.heartbeats[r].phase == Phase.DONE
               for r in obs.expected_ranks)


# A threshold falls due once strictly past it: look this long after (and never sooner
# than DUE_MIN_PAUSE_SECONDS after the last look, whatever the clocks say).
DUE_MARGIN_SECONDS = 0.01
DUE_MIN_PAUSE_SECONDS = 0.02
LEASE_RENEW_SECONDS = 10.0  # how often a watcher renews its DAG run's orchestrator lease


def next_pause(poll_interval: float, finishing_since: float | None, now: float,
               due_in: float | None = None) -> float:
    """Return how long to wait before the next poll: short while the ranks are exiting,
    and no later than ``due_in`` s from now, when a threshold falls due (Detector.due_at)."""
    pause = poll_interval
    if finishing_since is not None and now - finishing_since < FINISHING_FOR_SECONDS:
        pause = min(poll_interval, FINISHING_POLL_SECONDS)
    if due_in is not None:
        pause = min(pause, max(due_in + DUE_MARGIN_SECONDS, DUE_MIN_PAUSE_SECONDS))
    return pause


class SegmentWatchTrigger(BaseTrigger):
    """Watch one segment attempt launched by Relay until it completes or faults."""

    def __init__(
        self,
        attempt_dir: str,
        node_ranks: dict[str, list[int]],
        detection: dict[str, Any] | None = None,
        heartbeat_interval_seconds: float = 0.5,
        poll_interval_seconds: float = 0.5,
        kinds: list[str] | None = None,
        launcher: dict[str, Any] | None = None,
        unattended: dict[str, str] | None = None,
        boundary_step: int | None = None,
        launch_record: dict[str, Any] | None = None,
        spare: dict[str, Any] | None = None,
        settled: bool = False,
    ) -> None:
        super().__init__()
        self.settled = settled  # an adopted workload, past start-up already (relay.watch.slowness)
        self.spare = spare  # the standby to warm at a sign of a fault (relay.launchers.local.spare)
        # The attempt's launch config and handle (launchers.launch_record): the watcher finds the
        # attempt through it, and hands it back in its event (another machine may resume).
        self.launch_record = launch_record
        self.boundary_step = boundary_step  # completed once every rank is past it (see adopt)
        self.attempt_dir = attempt_dir
        self.node_ranks = node_ranks
        self.detection = detection or {}
        self.heartbeat_interval_seconds = heartbeat_interval_seconds
        self.poll_interval_seconds = poll_interval_seconds
        self.kinds = kinds  # the fault kinds to report (None: all); observe mode narrows it
        self.launcher = launcher
        # fault kind -> what a warden saves before stopping the workload (relay.recover.warden)
        self.unattended = unattended

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return the classpath and the exact ``__init__`` arguments."""
        return (
            "relay.watch.triggers.SegmentWatchTrigger",
            {
                "attempt_dir": self.attempt_dir,
                "node_ranks": self.node_ranks,
                "detection": self.detection,
                "heartbeat_interval_seconds": self.heartbeat_interval_seconds,
                "poll_interval_seconds": self.poll_interval_seconds,
                "kinds": self.kinds,
                "launcher": self.launcher,
                "unattended": self.unattended,
                "boundary_step": self.boundary_step,
                "launch_record": self.launch_record,
                "spare": self.spare,
                "settled": self.settled,
            },
        )

    def passed_boundary(self, obs: Observation) -> bool:
        """Return whether every rank has trained past ``boundary_step`` (the workload goes on).

        Heartbeats lag by an interval, and a rank that died or froze just after the
        boundary keeps one from before it; the fault is then the next segment's, whose
        task adopts the workload and handles it. Any of three proofs will do:

        - every rank's heartbeat is at the boundary or past it;
        - one rank has finished the boundary's own step (heartbeat past it): with a
          collective every step, it could only once rank 0 had started that step, and rank
          0 starts it after crossing (below). Ranks on other nodes say so when rank 0's
          node froze, agent and all, before that agent reported the crossing;
        - rank 0's record of crossing it, which its node's agent reports over the channel.
          Rank 0 records it at the step's start, once the boundary checkpoint is with its
          publisher, which DDP's collectives reach only after every rank finished the steps
          before.
        """
        if self.boundary_step is None:
            return False
        ranks = [r for ranks in self.node_ranks.values() for r in ranks]
        beats = [obs.heartbeats[r].step for r in ranks if r in obs.heartbeats]
        return (len(beats) == len(ranks) and min(beats) >= self.boundary_step) \
            or any(step > self.boundary_step for step in beats) \
            or (obs.launch is not None and self.boundary_step in obs.launch.crossed)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll until there is one thing to report, then report it."""
        root = Path(self.attempt_dir)
        carried = {"launch_record": self.launch_record} if self.launch_record else {}
        try:
            enabled = None if self.kinds is None else frozenset(FaultKind(k) for k in self.kinds)
            detector = Detector(Detection.model_validate(self.detection), enabled, self.settled)
            launcher = launcher_from(self.launcher)  # one per run: it remembers lease renewals
            if self.launch_record:
                launcher.attach(Attempt(root), dict(self.launch_record.get("handle") or {}))
            warmer = Warmer(self.spare, launcher)
            finishing_since: float | None = None  # when every rank's loop was seen ended
            renewed = -math.inf  # when this watcher last renewed the run's orchestrator lease
            while True:
                if launcher.continuity is not None and \
                        time.monotonic() - renewed > LEASE_RENEW_SECONDS:
                    renewed = time.monotonic()
                    await asyncio.to_thread(launcher.continuity.keep_run,
                                            Attempt(root).run_dir, RUN_LEASE_SECONDS)
                obs = await asyncio.to_thread(
                    observe_attempt, root, self.node_ranks, self.heartbeat_interval_seconds,
                    launcher,
                )
                quiet = silent_nodes(obs.launch, detector.cfg.poll_interval)
                await warmer.sign(f"the agent(s) of {', '.join(quiet)} stopped answering"
                                  if quiet else None)
                # Messages refused from agents of another attempt go with the event.
                refused = {"refused": obs.launch.refused} if obs.launch and obs.launch.refused \
                    else {}
                if obs.launch is not None and obs.launch.state is AttemptState.COMPLETED:
                    late = detector.at_completion(obs)
                    yield WatchEvent(
                        {**late.to_event(), "attempt_dir": self.attempt_dir, **refused,
                         **carried} if late
                        else {"status": AttemptState.COMPLETED.value,
                              "attempt_dir": self.attempt_dir, **refused, **carried}
                    )
                    return
                if self.passed_boundary(obs):  # this segment's steps are done; later ones
                    yield WatchEvent({"status": AttemptState.COMPLETED.value,
                                        "attempt_dir": self.attempt_dir,
                                        "boundary_step": self.boundary_step, "at": obs.now,
                                        **carried})
                    return  # are the next segment's to watch
                fault = detector.check(obs)
                if fault is None and warmer.due(time.monotonic()):
                    await warmer.sign(detector.suspects(obs))
                if fault is not None:
                    event = {**fault.to_event(), "attempt_dir": self.attempt_dir, **refused,
                             **carried}
                    step = (self.unattended or {}).get(fault.kind.value)
                    if step is not None:  # should no one resume the task (scheduler down)
                        await asyncio.to_thread(start_warden, root, event, step,
                                                self.detection, self.launcher)
                    yield WatchEvent(event)
                    return
                if finishing_since is None and finishing(obs):
                    finishing_since = time.monotonic()
                due = detector.due_at(obs)
                await asyncio.sleep(next_pause(self.poll_interval_seconds, finishing_since,
                                               time.monotonic(),
                                               None if due is None else due - time.time()))
        except Exception as exc:  # an error event, never a dead trigger
            yield WatchEvent({**_error_event(self.attempt_dir, exc).payload, **carried})


# What a sensor can see without a launcher: no exit codes, no agents.
HEARTBEAT_KINDS = frozenset(
    {FaultKind.HANG, FaultKind.RANK_UNRESPONSIVE, FaultKind.NODE_UNRESPONSIVE,
     FaultKind.LAUNCH_FAILURE, FaultKind.NAN_LOSS, FaultKind.STRAGGLER}
)
THROUGHPUT_KINDS = frozenset({FaultKind.THROUGHPUT_DEGRADED})


class HeartbeatWatchTrigger(BaseTrigger):
    """Watch any job that writes Relay heartbeats, launched by Relay or not.

    ``completed`` fires when every expected rank reports phase ``done``.
    """

    def __init__(
        self,
        heartbeat_dir: str,
        world_size: int,
        kinds: list[str],
        detection: dict[str, Any] | None = None,
        heartbeat_interval_seconds: float = 0.5,
        poll_interval_seconds: float = 1.0,
        started_at: float | None = None,
    ) -> None:
        super().__init__()
        self.heartbeat_dir = heartbeat_dir
        self.world_size = world_size
        self.kinds = kinds
        self.detection = detection or {}
        self.heartbeat_interval_seconds = heartbeat_interval_seconds
        self.poll_interval_seconds = poll_interval_seconds
        self.started_at = started_at if started_at is not None else time.time()

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return the classpath and the exact ``__init__`` arguments."""
        return (
            "relay.watch.triggers.HeartbeatWatchTrigger",
            {
                "heartbeat_dir": self.heartbeat_dir,
                "world_size": self.world_size,
                "kinds": self.kinds,
                "detection": self.detection,
                "heartbeat_interval_seconds": self.heartbeat_interval_seconds,
                "poll_interval_seconds": self.poll_interval_seconds,
                "started_at": self.started_at,
            },
        )

    def observe(self) -> Observation:
        beats = read_heartbeats(Path(self.heartbeat_dir))
        node_ranks: dict[str, list[int]] = {}
        for beat in beats.values():
            node_ranks.setdefault(beat.node, []).append(beat.rank)
        missing = [r for r in range(self.world_size) if r not in beats]
        if missing:
            node_ranks.setdefault("(not yet seen)", []).extend(missing)
        return Observation(
            now=time.time(), launched_at=self.started_at, heartbeats=beats,
            node_ranks=node_ranks, heartbeat_interval=self.heartbeat_interval_seconds,
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll heartbeats until the job is done or a watched fault shows."""
        try:
            detector = Detector(
                Detection.model_validate(self.detection),
                frozenset(FaultKind(k) for k in self.kinds),
            )
            while True:
                obs = await asyncio.to_thread(self.observe)
                beats = obs.heartbeats
                if len(beats) >= self.world_size and all(
                    b.phase == Phase.DONE.value for b in beats.values()
                ):
                    late = detector.at_completion(obs)
                    yield WatchEvent(
                        {**late.to_event(), "attempt_dir": self.heartbeat_dir} if late
                        else {"status": AttemptState.COMPLETED.value,
                              "attempt_dir": self.heartbeat_dir}
                    )
                    return
                fault = detector.check(obs)
                if fault is not None:
                    yield WatchEvent({**fault.to_event(), "attempt_dir": self.heartbeat_dir})
                    return
                silent = self.silent_ranks(obs, detector.cfg.heartbeat_timeout)
                if silent is not None:
                    yield WatchEvent({"status": AttemptState.FAILED.value,
                                        "attempt_dir": self.heartbeat_dir,
                                        "message": f"the job ended, but ranks {silent} never "
                                        "reported done (their heartbeats stopped)"})
                    return
                await asyncio.sleep(self.poll_interval_seconds)
        except Exception as exc:  # an error event, never a dead trigger
            yield _error_event(self.heartbeat_dir, exc)

    def silent_ranks(self, obs: Observation, timeout: float) -> list[int] | None:
        """Return the silent ranks once every rank is either done or silent, else None."""
        beats = obs.heartbeats
        if len(beats) < self.world_size:
            return None
        silent = sorted(r for r, b in beats.items()
                        if b.phase != Phase.DONE.value and obs.now - b.wall_clock > timeout)
        done = [r for r, b in beats.items() if b.phase == Phase.DONE.value]
        return silent if silent and len(silent) + len(done) == len(beats) else None
