"""The local launcher's :class:`~relay.launchers.base.Continuity`: warm starts and handovers.

The segment task reaches this machinery only through ``launcher.continuity``;
the mechanisms live beside it: warm starts in :mod:`.warm_start` (standbys,
the run's resident), :mod:`.prestart` (a resident started before its DAG run)
and :mod:`.spare` (a standby warmed at a sign of a fault); handovers in
:mod:`.adopt`.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.core.attempt import Attempt
from relay.launchers.local import adopt, spare
from relay.launchers.local import prestart as local_prestart
from relay.launchers.local.warm_agents import STANDBY_DIR, release_run
from relay_train.protocol import run_lease
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig
from relay_train.protocol.routes import STANDBY_TTL_SECONDS
from relay_train.protocol.run_lease import RUN_LEASE_SECONDS

if TYPE_CHECKING:
    from relay.launchers.local.launcher import LocalLauncher
    from relay.spec.job import JobSpec

log = logging.getLogger(__name__)


class LocalContinuity:
    """Warm starts and handovers of a :class:`~relay.launchers.local.launcher.LocalLauncher`."""

    def __init__(self, launcher: LocalLauncher) -> None:
        self.launcher = launcher

    # -- warm starts -------------------------------------------------------------------

    def prepare_run(self, run_dir: Path, nodes: list[str], conf: object, dag_id: str) -> None:
        """Keep the run's resident agent on the first of ``nodes`` (this launcher's nodes
        share one host): the one Relay's runner prestarted beside Airflow's start-up, if
        the run's conf names one for this DAG, else a new one; a prestarted one this run
        does not take is stopped."""
        prestarted = local_prestart.prestarted(conf, dag_id)
        try:
            if nodes:
                self.launcher.reside(run_dir, nodes[:1], prestarted)
        finally:
            if prestarted is not None:
                local_prestart.release_untaken(prestarted)

    def warm_for_retry(self, faulty: Attempt, nodes: list[str], ttl_seconds: float) -> None:
        """Have standbys preload in the segment's standby folder, where the retry's launch
        looks: copies of ``faulty``'s agents that still answer, else forked by the run's
        resident."""
        self.launcher.warm_standbys(faulty.segment_dir / STANDBY_DIR, nodes, ttl_seconds,
                               source=Attempt(faulty.runs_in))

    def plan_spare(self, attempt: Attempt, free: list[str]) -> dict[str, Any] | None:
        """Keep the run's resident on the first free node and plan its standby there."""
        self.launcher.reside(attempt.run_dir, free[:1])
        return spare.plan(attempt.segment_dir / STANDBY_DIR, free, STANDBY_TTL_SECONDS)

    def warm_spare(self, planned: dict[str, Any], why: str) -> None:
        """Start the planned standby (blocking)."""
        log.warning("%s: warming a standby on %s for a retry", why, planned["node"])
        self.launcher.warm_standbys(Path(planned["directory"]), [planned["node"]],
                               float(planned["ttl"]))

    def keep_run(self, run_dir: Path, seconds: float = RUN_LEASE_SECONDS) -> None:
        """Renew the run's orchestrator lease (:mod:`relay_train.protocol.run_lease`), which
        its resident and its lingering agents read."""
        run_lease.renew(run_dir, seconds, by=f"relay pid {os.getpid()}")

    def end_run(self, run_dir: Path, stop_workloads: bool = True) -> list[Path]:
        """Stop the run's workloads Relay has not let go of (unless ``stop_workloads`` is
        False: its segments never hand a workload over) and its warm agents."""
        stopped = adopt.stop_run_workloads(run_dir, self.launcher) if stop_workloads else []
        release_run(run_dir)
        return stopped

    # -- handovers ---------------------------------------------------------------------

    def hands_over(self, spec: JobSpec) -> bool:
        """Return whether the job's segments hand their workload over (``adopt``)."""
        return spec.segment_boundary == "adopt"

    def run_on(self, spec: JobSpec, index: int) -> tuple[list[int], int | None]:
        """Return the job's segment ends and the next segment's end (None: the last)."""
        return adopt.lookahead(spec, index)

    def guard(self, run_dir: Path, index: int,
              silent_seconds: float) -> AbstractContextManager[None]:
        """See :func:`relay.launchers.local.adopt.freeze_guard`."""
        return adopt.freeze_guard(run_dir, index, self.launcher, silent_seconds)

    def stop_adopted(self, segment_dir: Path) -> list[str]:
        """Stop the workloads earlier tries of this segment adopted."""
        return adopt.stop_adopted(segment_dir, self.launcher)

    def adoptable(self, run_dir: Path, index: int, end: int, resume_step: int,
                  healthy: list[str]) -> Path | None:
        """Return the workload segment ``index`` may adopt, if any. One it may not adopt
        is left be when there is nothing to train here (a later segment may adopt it),
        and stopped and let go of otherwise."""
        workload = adopt.live_workload(run_dir, index, self.launcher)
        if workload is None:
            return None
        why = adopt.refusal(workload, end, resume_step)
        if why is None:
            nodes = LaunchConfig.read(workload / LAUNCH_FILE).nodes
            held = sorted(set(nodes) - set(healthy))
            if held:
                why = f"node(s) {', '.join(held)} are quarantined now"
        if why is None:
            return workload
        if resume_step < end:
            log.warning("Not adopting the workload %s: %s. Stopping it and launching afresh",
                        workload, why)
            self.launcher.stop(Attempt(workload))
            adopt.let_go(workload)
        return None

    def adopt(self, folder: Path, workload: Path, *, run_id: str, segment: int, attempt: int,
              resume_step: int, end: int, next_end: int | None) -> int | None:
        """See :func:`relay.launchers.local.adopt.adopt`."""
        return adopt.adopt(folder, workload, run_id=run_id, segment=segment, attempt=attempt,
                           resume_step=resume_step, end=end, next_end=next_end)

    def kept_interval(self, workload: Path, folder: Path, steps: int) -> dict[str, str]:
        """See :func:`relay.launchers.local.adopt.kept_interval`."""
        return adopt.kept_interval(workload, folder, steps)

    def attempt_at(self, folder: Path) -> Attempt:
        """Return the attempt of ``folder``, with the workload it adopted, if any."""
        return Attempt(folder, adopt.workload_of(folder))

    def view(self, attempt: Attempt, cfg: LaunchConfig) -> LaunchConfig:
        """See :func:`relay.launchers.local.adopt.attempt_view`."""
        return adopt.attempt_view(attempt.folder, cfg)

    def watch_boundary(self, view: LaunchConfig, workload: LaunchConfig) -> int | None:
        """See :func:`relay.launchers.local.adopt.watch_boundary`."""
        return adopt.watch_boundary(view, workload)

    def let_go(self, attempt: Attempt) -> None:
        """Never adopt the attempt's workload again."""
        adopt.let_go(attempt.runs_in)

    def note_boundary(self, attempt: Attempt, fired_at: float | None, woke_at: float) -> None:
        """See :func:`relay.launchers.local.adopt.note_boundary`."""
        adopt.note_boundary(attempt.folder, fired_at, woke_at)

    def wait_published(self, lineage: Any, parent: str, run_id: str, step: int,  # noqa: ANN401
                       timeout_seconds: float, workload: Path) -> bool:
        """See :func:`relay.launchers.local.adopt.wait_published`."""
        return adopt.wait_published(lineage, parent, run_id, step, timeout_seconds, workload)

    def copy_strikes(self, attempt: Attempt) -> None:
        """See :func:`relay.launchers.local.adopt.copy_strikes`."""
        if attempt.adopted:
            adopt.copy_strikes(attempt.runs_in, attempt.folder)

    def run_id_of(self, attempt: Attempt) -> str:
        """See :func:`relay.launchers.local.adopt.run_id_of`."""
        return adopt.run_id_of(attempt.folder)

    def wait_for_end(self, run_dir: Path, index: int) -> None:
        """See :func:`relay.launchers.local.adopt.wait_for_end`."""
        adopt.wait_for_end(run_dir, index, self.launcher)
