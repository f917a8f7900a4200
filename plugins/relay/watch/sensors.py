"""Public deferrable sensors on the watcher's logic, for any job that writes Relay heartbeats.

They need no Relay launcher: point them at a heartbeat folder (the job writes
records with ``relay_train.protocol.heartbeat.HeartbeatWriter``) and the number of ranks.
They succeed when every rank reports ``done`` and fail, naming the fault, its
culprit and the evidence, as soon as the watched signals show one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from airflow.sdk import BaseSensorOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from relay.core.attempt import AttemptState
from relay.core.exceptions import PathEscapeError
from relay.core.faults import Fault, FaultKind
from relay.core.paths import ENV_WATCH_ROOTS, inside
from relay.policy.model import Detection, load_policy
from relay.spec.policy_files import policies_dir
from relay.watch.detection import Detector
from relay.watch.triggers import HEARTBEAT_KINDS, THROUGHPUT_KINDS, HeartbeatWatchTrigger
from relay_train.protocol.heartbeat import Phase


class _HeartbeatWatchSensor(BaseSensorOperator):
    """Watch a heartbeat folder for the given fault kinds until the job is done."""

    template_fields = ("heartbeat_dir", "world_size", "policy_file")
    kinds: frozenset[FaultKind] = frozenset()

    def __init__(
        self,
        *,
        heartbeat_dir: str,
        world_size: int | str,
        policy_file: str | None = None,
        heartbeat_interval_seconds: float = 0.5,
        deferrable: bool = True,
        confine_to: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # Set when the paths come from run conf: heartbeat_dir must be inside one of these
        # folders, policy_file inside the policies folder.
        self.confine_to = confine_to
        self.heartbeat_dir = heartbeat_dir
        self.world_size = world_size
        self.policy_file = policy_file
        self.heartbeat_interval_seconds = heartbeat_interval_seconds
        self.deferrable = deferrable
        self._detector: Detector | None = None
        self._started_at = time.time()

    def _detection(self) -> Detection:
        if not self.policy_file:
            return Detection()
        return load_policy(Path(self.policy_file)).policy.detection

    def _check_paths(self) -> None:
        """Refuse run-conf paths outside where they belong (only when ``confine_to`` is set)."""
        if self.confine_to is None:
            return
        try:
            inside(str(self.heartbeat_dir), [Path(r) for r in self.confine_to], "heartbeat_dir",
                   f"put the job's heartbeats under one of them, or add its folder to "
                   f"{ENV_WATCH_ROOTS} where Airflow runs")
            if self.policy_file:
                inside(str(self.policy_file), [policies_dir()], "policy_file",
                       "name a policy file in the policies folder")
        except PathEscapeError as exc:
            raise AirflowFailException(str(exc)) from exc

    def _trigger(self) -> HeartbeatWatchTrigger:
        self._check_paths()
        detection = self._detection()
        return HeartbeatWatchTrigger(
            heartbeat_dir=str(self.heartbeat_dir),
            world_size=int(self.world_size),
            kinds=sorted(k.value for k in self.kinds),
            detection=detection.model_dump(),
            heartbeat_interval_seconds=self.heartbeat_interval_seconds,
            poll_interval_seconds=min(detection.poll_interval, float(self.poke_interval)),
            started_at=time.time(),
        )

    def execute(self, context: Any) -> Any:  # noqa: ANN401
        """Defer to the watcher (or poke in-process when not deferrable)."""
        if not self.deferrable:
            return super().execute(context)
        self.defer(trigger=self._trigger(), method_name="execute_complete")
        return None

    def poke(self, context: Any) -> bool:  # noqa: ANN401
        """Look once: True when every rank is done; raise on a fault."""
        trigger = self._trigger()
        if self._detector is None:
            self._detector = Detector(self._detection(), self.kinds)
        trigger.started_at = self._started_at
        obs = trigger.observe()
        beats = obs.heartbeats
        if len(beats) >= int(self.world_size) and all(
            b.phase == Phase.DONE.value for b in beats.values()
        ):
            return True
        fault = self._detector.check(obs)
        timeout = self._detector.cfg.heartbeat_timeout
        silent = trigger.silent_ranks(obs, timeout) if fault is None else None
        if silent is not None:
            raise AirflowException(f"{self.task_id}: the job ended, but ranks {silent} never "
                                   "reported done")
        if fault is not None:
            raise AirflowException(
                f"{self.task_id}: {fault.describe()} — evidence {fault.evidence}"
            )
        return False

    def execute_complete(self, context: Any, event: dict[str, Any]) -> None:  # noqa: ANN401
        """Succeed on ``completed``; fail with the fault or watcher error otherwise."""
        status = event.get("status")
        if status == AttemptState.COMPLETED:
            self.log.info("Every rank in %s reported done", self.heartbeat_dir)
            return
        if status == AttemptState.FAULTED:
            fault = Fault.from_event(event["fault"])
            raise AirflowException(
                f"{self.task_id}: {fault.describe()} — evidence {fault.evidence}"
            )
        raise AirflowException(f"{self.task_id}: {event.get('message')}")


class HeartbeatSensor(_HeartbeatWatchSensor):
    """Wait for a job to finish; fail on a hang, a silent rank or node, a straggler, a NaN loss."""

    kinds = HEARTBEAT_KINDS


class ThroughputSensor(_HeartbeatWatchSensor):
    """Wait for a job to finish; fail when its samples/s falls below the policy's floor."""

    kinds = THROUGHPUT_KINDS
