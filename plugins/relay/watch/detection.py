"""Turn what the watcher observes into at most one classified fault.

:class:`Detector` is deterministic: feed it :class:`Observation` snapshots (the
heartbeats, the launcher's status, the clock) and it answers with a
:class:`~relay.core.faults.Fault` or ``None``. The only state it keeps is what
"sustained" and "baseline" need; losing it (a triggerer restart) only delays
those two rules. Rules are checked in a fixed order, most specific first, so
one fault is reported once, under its most useful name. The straggler and
throughput rules live in :mod:`relay.watch.slowness`; a throughput fault whose cause is one
node's slow link is named a straggler of that node by :mod:`relay.watch.slow_link`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from relay.core.attempt import AttemptState
from relay.core.faults import Fault, FaultKind
from relay.launchers.agent_client import FRESH_WAIT_SECONDS
from relay.policy.model import Detection
from relay.watch.columns import Floats, RankArrays, RankColumns
from relay.watch.exits import before_first_step, classify_exit, only_secondary_exits, preemption
from relay.watch.hangs import find_hang
from relay.watch.lockstep import Lockstep
from relay.watch.observation import (
    COMPUTE,
    DONE,
    STARTING,
    WAITING,
    WORKING,
    Observation,
    past_startup,
)
from relay.watch.slow_link import LinkWatch
from relay.watch.slowness import StragglerRule, ThroughputRule
from relay.watch.steptime import HangLimit, StepTimes
from relay_train.protocol.heartbeat import Heartbeat
from relay_train.protocol.routes import SETTLED, NodeState

# How late a live agent's word may come: it answers every poll, and a poll waits up to
# this long for an answer (a later one counts at the next poll).
AGENT_STATUS_INTERVAL_SECONDS = FRESH_WAIT_SECONDS


class Detector:
    """Classify faults from observations, per the policy's detection thresholds."""

    def __init__(self, detection: Detection, enabled: frozenset[FaultKind] | None = None,
                 settled: bool = False) -> None:
        """``settled``: the ranks were past start-up before this detector looked (an
        adopted workload): the straggler rule judges from its first observation."""
        self.cfg = detection
        self.enabled = enabled if enabled is not None else frozenset(FaultKind)
        self._straggler = (StragglerRule(detection.straggler, settled)
                           if detection.straggler else None)
        self._throughput = ThroughputRule(detection.throughput) if detection.throughput else None
        self._links = LinkWatch()  # names the node whose slow link slowed the job
        # per rank: its step, and when this detector saw it reached (relay.watch.columns)
        self._stepped = RankArrays(step=(np.int64, 0), at=(np.float64, 0.0))
        self._lockstep = Lockstep()  # a node unheard while the others step on is alive
        self._secondary_since: float | None = None
        self._watching_since: float | None = None  # this detector's first observation
        self._steps = StepTimes()  # for a hang threshold derived from the job's step time
        self._active_of: tuple[Observation, RankColumns] | None = None  # (see _active)

    @property
    def baseline(self) -> float | None:
        """Return the job's measured throughput baseline (samples/s), once known."""
        return self._throughput.baseline if self._throughput else None

    def check(self, obs: Observation) -> Fault | None:
        """Return the fault these observations show, if any."""
        if self._watching_since is None:
            self._watching_since = obs.now
        self._active_of = (obs, self._step_on(obs))
        self._lockstep.observe(obs.columns)
        self._links.observe(obs)
        if self.cfg.derive_hang_timeout is not None:
            self._steps.observe(obs.columns, self.cfg.derive_hang_timeout.warmup_steps)
        rules = (
            ({FaultKind.PREEMPTED}, self._preempted),  # before the exits its stop may cause
            ({FaultKind.CRASH, FaultKind.LAUNCH_FAILURE, FaultKind.SHORT_SEGMENT}, self._exits),
            ({FaultKind.NAN_LOSS}, self._nan),
            ({FaultKind.LAUNCH_FAILURE}, self._startup),
            ({FaultKind.NODE_UNRESPONSIVE}, self._platform_unresponsive),
            ({FaultKind.NODE_UNRESPONSIVE, FaultKind.RANK_UNRESPONSIVE}, self._stale),
            ({FaultKind.HANG}, self._hang),
            ({FaultKind.STRAGGLER}, self._stragglers),
            ({FaultKind.THROUGHPUT_DEGRADED}, self._throughput_degraded),
        )
        for kinds, rule in rules:
            if kinds & self.enabled:
                fault = rule(obs)
                if fault is not None and fault.kind in self.enabled:
                    return fault
        return None

    # -- notices, exits and start-up -----------------------------------------

    def _preempted(self, obs: Observation) -> Fault | None:
        return None if obs.launch is None else preemption(obs.launch, obs.now)

    def _exits(self, obs: Observation) -> Fault | None:
        if obs.launch is None or obs.launch.state is not AttemptState.FAILED:
            return None
        unsettled = [n for n in obs.launch.nodes.values() if n.state not in SETTLED]
        if only_secondary_exits(obs.launch) and unsettled:
            # The peers of a dead rank can report before the dead rank's own agent does;
            # blaming the first to report would name a bystander. Wait for the others.
            if self._secondary_since is None:
                self._secondary_since = obs.now
            if obs.now - self._secondary_since < 2 * AGENT_STATUS_INTERVAL_SECONDS:
                return None
        fault = classify_exit(obs.launch, obs.node_ranks)
        if fault is None:
            return None
        fault = dataclasses.replace(fault, detected_at=obs.now)
        if fault.culprit_rank is None or fault.kind is FaultKind.SHORT_SEGMENT:
            return fault
        beat = obs.heartbeats.get(fault.culprit_rank)
        if beat is None or beat.phase == STARTING:
            # It died before its first step: the launch failed, not the training.
            return before_first_step(fault, obs.launch, obs.now)
        return fault

    def _startup(self, obs: Observation) -> Fault | None:
        waited = obs.now - obs.launched_at
        if waited <= self.cfg.startup_timeout:
            return None
        stepping = past_startup(obs)
        for rank in obs.expected_ranks:
            beat = obs.heartbeats.get(rank)
            if beat is not None and beat.phase != STARTING:
                continue
            node = obs.node_of(rank)
            if beat is None and stepping and node and self._agent_age(obs, node) == math.inf:
                continue  # it rendezvoused, then its node fell silent: the liveness rules
            # no heartbeat yet, or still starting
            state = "no heartbeat" if beat is None else "still starting"
            return Fault(
                FaultKind.LAUNCH_FAILURE, rank, obs.node_of(rank),
                {"summary": f"{state} {waited:.1f}s after launch "
                 f"(startup_timeout {self.cfg.startup_timeout:g}s)",
                 "missing_ranks": [r for r in obs.expected_ranks if r not in obs.heartbeats]},
                obs.now,
            )
        return None

    def at_completion(self, obs: Observation) -> Fault | None:
        """Return the fault a run that ended cleanly still had: a non-finite loss.

        The ranks may finish a few steps after a NaN, before any poll saw it; the
        run then "succeeded" with poisoned weights (and no final checkpoint).
        """
        return self._nan(obs) if FaultKind.NAN_LOSS in self.enabled else None

    def _nan(self, obs: Observation) -> Fault | None:
        if not self.cfg.nan_loss:
            return None
        bad = [
            b for b in obs.heartbeats.values()
            if b.nonfinite_step is not None or (b.loss is not None and not math.isfinite(b.loss))
        ]
        if not bad:
            return None

        def first_bad_step(b: Heartbeat) -> int:
            return b.nonfinite_step if b.nonfinite_step is not None else b.step

        # Every rank goes NaN one step after the first (the all-reduce spreads it):
        # the culprit is the rank whose loss went first, not the one read first.
        first = min(bad, key=lambda b: (first_bad_step(b), b.rank))
        step = first_bad_step(first)
        return Fault(FaultKind.NAN_LOSS, first.rank, first.node,
                     {"summary": f"loss became {first.loss} at step {step}",
                      "step": step, "ranks": sorted(b.rank for b in bad)}, obs.now)

    # -- liveness -------------------------------------------------------------

    def _age(self, beat: Heartbeat, now: float) -> float:
        return now - beat.wall_clock

    def _is_stale(self, beat: Heartbeat, now: float) -> bool:
        return beat.phase != DONE and self._age(beat, now) > self.cfg.heartbeat_timeout

    def _agent_age(self, obs: Observation, node: str) -> float | None:
        """Return how long ago the node's agent last spoke (None: no agent to ask)."""
        if obs.launch is None or node not in obs.launch.nodes:
            return None
        seen = obs.launch.nodes[node].last_seen
        return float("inf") if seen is None else obs.now - seen

    def _platform_unresponsive(self, obs: Observation) -> Fault | None:
        """A node the launcher's platform says stopped answering (NotReady, stuck pod)."""
        if obs.launch is None:
            return None
        for node in obs.launch.nodes.values():
            if node.state == NodeState.UNRESPONSIVE:
                return Fault(FaultKind.NODE_UNRESPONSIVE, None, node.node,
                             {"summary": node.detail or f"{node.node} stopped answering",
                              "host": node.host}, obs.now)
        return None

    def _unheard(self, obs: Observation, limit: float) -> set[int]:
        """Return the ranks this watcher never heard although the job is past start-up.

        A watcher that adopted a running workload (or restarted) starts with no
        heartbeats; a node frozen before that never sends one. Once any rank steps,
        every rank rendezvoused, so a rank unheard for ``limit`` s is silent.
        """
        since = self._watching_since
        if obs.launch is None or since is None or obs.now - since <= limit:
            return set()
        if not past_startup(obs):
            return set()
        return {r for r in obs.expected_ranks if r not in obs.heartbeats}

    def _first_step(self, obs: Observation) -> bool:
        """Return whether a fresh job is still in its first step, within startup_timeout:
        every record at step 0 (DDP's parameter broadcast and gloo's first connections
        are start-up too; on a loaded host an agent still busy starting goes unheard for
        seconds meanwhile). A node frozen then is called at startup_timeout."""
        return (obs.now - obs.launched_at <= self.cfg.startup_timeout
                and all(b.step == 0 for b in obs.heartbeats.values()))

    def _silent(self, obs: Observation, idle: str) -> set[int]:
        """Return the ranks silent for over heartbeat_timeout, neither done nor ``idle``."""
        cols = obs.columns
        busy = ~cols.in_phase(DONE) & ~cols.in_phase(idle)
        return set(cols.rank[busy & (obs.now - cols.wall_clock > self.cfg.heartbeat_timeout)]
                   .tolist())

    def _stale(self, obs: Observation) -> Fault | None:
        # A node is unresponsive once its ranks and its agent have all been silent for
        # heartbeat_timeout (the policy's "silent"). A frozen node's ranks fall silent
        # within one heartbeat interval of each other, its agent at the same time: wait
        # for that before blaming a rank (below).
        agent_limit = self.cfg.heartbeat_timeout
        unheard = self._unheard(obs, agent_limit)
        now, timeout = obs.now, self.cfg.heartbeat_timeout  # _is_stale, inlined: every rank
        # Until a rank steps, silence is start-up's (imports, rendezvous: on a loaded host an
        # agent busy starting goes unheard for seconds): startup_timeout judges it (_startup).
        past = past_startup(obs)
        if past and self._first_step(obs):
            return None  # still start-up: the first step of a fresh job (see _first_step)
        stale = self._silent(obs, DONE if past else STARTING)
        if not stale and not unheard:
            return None
        # Other nodes' ranks that stepped on after a silent rank's last word prove it alive.
        alive = self._lockstep.alive_since(list(obs.node_ranks), obs.node_of)
        if alive:
            stale = {r for r in stale if now - alive.get(obs.node_of(r) or "", 0.0) > timeout}
            if not stale and not unheard:
                return None
        grace = AGENT_STATUS_INTERVAL_SECONDS + 2 * obs.heartbeat_interval
        for node, ranks in obs.node_ranks.items():
            if FaultKind.NODE_UNRESPONSIVE not in self.enabled:
                break
            agent_age = self._agent_age(obs, node)
            if ranks and set(ranks) <= stale | unheard and (
                    agent_age is None or agent_age > agent_limit) and (
                    node not in alive or now - alive[node] > agent_limit):
                ages = {r: round(self._age(obs.heartbeats[r], obs.now), 2)
                        if r in obs.heartbeats else None for r in ranks}
                return Fault(FaultKind.NODE_UNRESPONSIVE, None, node,
                             {"summary": f"every rank of {node} and its agent went silent",
                              "heartbeat_age_seconds": ages,
                              "agent_age_seconds": None if agent_age in (None, math.inf)
                              else round(agent_age, 2)}, obs.now)
        for rank in sorted(stale, key=lambda r: obs.heartbeats[r].wall_clock):
            beat = obs.heartbeats[rank]
            age = self._age(beat, obs.now)
            agent_age = self._agent_age(obs, beat.node)
            if agent_age is not None:
                # The agent speaks every second: only a word from it well after the rank
                # went quiet shows the node itself is still alive.
                spoke_after = (obs.now - agent_age) - beat.wall_clock
                if spoke_after < AGENT_STATUS_INTERVAL_SECONDS + 0.25:
                    continue  # maybe the whole node is going silent: look again next poll
            elif age <= self.cfg.heartbeat_timeout + grace:
                continue  # no agent to ask: give the node's other ranks time to fall silent
            return Fault(FaultKind.RANK_UNRESPONSIVE, rank, beat.node,
                         {"summary": f"no heartbeat for {age:.1f}s (heartbeat_timeout "
                          f"{self.cfg.heartbeat_timeout:g}s), last at step {beat.step} in "
                          f"{beat.phase}", "heartbeat_age_seconds": round(age, 2),
                          "pid": beat.pid}, obs.now)
        return None

    def due_at(self, obs: Observation) -> float | None:
        """Return the soonest time after ``obs.now`` at which a liveness or hang threshold
        falls due should nothing new be heard (None: none pending).

        The watcher looks again then instead of up to a poll interval later, so these
        faults are called when the policy's threshold says, not up to ``poll_interval``
        after. It costs nothing while the job is healthy: fresh heartbeats put every such
        time seconds away, past the next poll.
        """
        now, timeout, cols = obs.now, self.cfg.heartbeat_timeout, obs.columns
        live = ~cols.in_phase(DONE)
        hang = FaultKind.HANG in self.enabled and bool((live & cols.in_phase(*WAITING)).any())
        silence = bool(self.enabled & {FaultKind.NODE_UNRESPONSIVE, FaultKind.RANK_UNRESPONSIVE})
        due: list[Floats] = []  # the times each threshold falls due, over the columns
        if hang:
            due.append(cols.phase_started_at[live & cols.in_phase(COMPUTE)]
                       + self.hang_limit(obs).seconds)
        if silence:
            due.append(cols.wall_clock[live] + timeout)
        soonest: float | None = None
        for times in due:
            later = times[times > now]
            if len(later) and (soonest is None or later.min() < soonest):
                soonest = float(later.min())
        if silence and obs.launch is not None:
            for n in obs.launch.nodes.values():
                if n.last_seen is not None and (t := n.last_seen + timeout) > now and (
                        soonest is None or t < soonest):
                    soonest = t
        return soonest

    def suspects(self, obs: Observation) -> str | None:
        """Return why a fault seems on its way though none is called yet (see local.spare):
        a rank in compute past half the hang threshold while another waits, or a rank
        half way to being called a straggler. Call it after :meth:`check`."""
        beats = [b for b in obs.heartbeats.values() if b.phase != DONE]
        if FaultKind.HANG in self.enabled and any(b.phase in WAITING for b in beats):
            half = self.hang_limit(obs).seconds / 2
            stalled = [b.rank for b in beats if b.phase == COMPUTE
                       and obs.now - b.phase_started_at > half]
            if stalled:
                return f"rank {stalled[0]} in compute for over {half:.1f}s while others wait"
        if self._straggler is not None and FaultKind.STRAGGLER in self.enabled:
            slow = self._straggler.slow_ranks(obs.now)
            if slow:
                return (f"rank {slow[0]} half way to a straggler (over "
                        f"{self._straggler.ratio:.3g}x the others' compute)")
        return None

    def hang_limit(self, obs: Observation) -> HangLimit:
        """Return the hang threshold in force: the policy's, or derived from the steps seen."""
        derive = self.cfg.derive_hang_timeout
        if derive is None:
            return HangLimit(self.cfg.hang_timeout, "")
        return self._steps.hang_limit(self.cfg.hang_timeout, obs.heartbeat_interval,
                                      derive.safety_factor, derive.min)

    def _hang(self, obs: Observation) -> Fault | None:
        return find_hang(obs, self.cfg, self.hang_limit(obs))

    # -- performance ------------------------------------------------------------

    def _step_on(self, obs: Observation) -> RankColumns:
        """Note when each rank's step last moved; return the ranks that are stepping: working,
        and their step moved recently (over the poll's columns: 8,192 ranks a poll at 1,024
        nodes).

        A stalled job freezes every rank's last compute time and rate; judging speed on
        those frozen numbers would call a hang a straggler.
        """
        cols, stepped, now = obs.columns, self._stepped, obs.now
        stepped.fit(cols.rank)
        rank, step = cols.rank, cols.step
        moved = ~stepped.seen[rank] | (step != stepped["step"][rank])
        stepped["step"][rank[moved]], stepped["at"][rank[moved]] = step[moved], now
        stepped.seen[rank] = True
        recent = now - stepped["at"][rank] <= self.cfg.hang_timeout / 2
        return cols.subset(cols.in_phase(*WORKING) & recent)

    def stepped(self) -> dict[int, tuple[int, float]]:
        """Return rank -> its step and when this detector saw it reached."""
        return self._stepped.by_rank("step", "at")

    def _active(self, obs: Observation) -> RankColumns:
        """Return the ranks stepping in ``obs``, as :meth:`check` found them (see _step_on)."""
        if self._active_of is None or self._active_of[0] is not obs:
            self._active_of = (obs, self._step_on(obs))
        return self._active_of[1]

    def _stragglers(self, obs: Observation) -> Fault | None:
        if self._straggler is None:
            return None
        return self._straggler.check(self._active(obs), obs.now)

    def _throughput_degraded(self, obs: Observation) -> Fault | None:
        if self._throughput is None:
            return None
        fault = self._throughput.check(self._active(obs).beats, len(obs.heartbeats), obs.now)
        if fault is None or FaultKind.STRAGGLER not in self.enabled:
            return fault
        return self._links.attribute(fault)  # a straggler of the node whose link is slow
