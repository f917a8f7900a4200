"""The recovery policy: YAML owned by governance, validated into a frozen model.

The detection section holds the watcher's thresholds; ``rules`` holds one
recovery rule per fault kind (:mod:`relay.policy.rules`). Durations read ``500ms``,
``30s``, ``5m``. Every problem comes back at once with file:line and a fix.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from relay.core.exceptions import ConfigError
from relay.policy.rules import Escalation, Mode, NodeRules, Rules
from relay.spec.validation_problems import validate_model
from relay.spec.yamlsource import (
    FROZEN,
    Duration,
    FieldValueError,
    load_yaml_with_lines,
)

_DURATIONS = (
    "poll_interval", "startup_timeout", "heartbeat_timeout", "hang_timeout", "checkpoint_timeout",
    "evidence_timeout", "stop_unattended_after",
)


# What the mechanisms add to the thresholds a policy sets; `relay policy explain` states them.
MIN_SLOW_STEPS = 3  # distinct steps seen over the straggler ratio before lost_seconds may fire
CLAIM_SECONDS = 2.0  # how long an actor waits for the agents' answers to its claim
STOP_GRACE_SECONDS = 5.0  # a stop waits this long after SIGTERM, and again after SIGKILL
# The warden stops an unattended workload at most stop_unattended_after + checkpoint_timeout
# + this after the fault was detected: the claim, then the two waits of the stop.
UNATTENDED_MARGIN_SECONDS = CLAIM_SECONDS + 2 * STOP_GRACE_SECONDS


class StragglerDetection(BaseModel):
    """A rank is a straggler when its compute time stays above ratio x the others' median.

    It fires once the job has lost ``lost_seconds`` waiting on the rank (a much slower
    rank costs more per second, so it is called sooner; see ``relay.watch.slowness``), and at
    the latest after ``sustained``. ``lost_seconds: null``: ``sustained`` alone.
    """

    model_config = FROZEN

    ratio: float = Field(1.5, gt=1.0)
    sustained: Duration = 3.0
    lost_seconds: Duration | None = 1.0

    @field_validator("lost_seconds", mode="after")
    @classmethod
    def _positive(cls, seconds: float | None) -> float | None:
        # At or above sustained it simply never fires first (sustained does): allowed, so a
        # policy that shortens sustained below the 1 s default needs no lost_seconds of its own.
        if seconds is not None and seconds <= 0:
            raise FieldValueError(
                "a duration > 0, such as 1s", seconds,
                "set lost_seconds above 0, e.g. lost_seconds: 1s, or null to wait the whole "
                "sustained time", shown=f"{seconds:g}s")
        return seconds


class ThroughputDetection(BaseModel):
    """Job throughput is degraded when it stays below floor x its own baseline."""

    model_config = FROZEN

    floor: float = Field(0.6, gt=0.0, lt=1.0)
    sustained: Duration = 5.0
    warmup_steps: int = Field(10, ge=1)
    baseline: Duration = 5.0


class HangFromStepTime(BaseModel):
    """Derive the hang threshold from the job's own steps (``relay.watch.steptime``), bounded.

    threshold = heartbeat_interval + safety_factor x the p95 step time (checkpoint
    intervals left out), held within [min, hang_timeout]; hang_timeout applies until
    warmup_steps are seen.
    """

    model_config = FROZEN

    safety_factor: float = Field(10.0, ge=2.0)
    min: Duration = 2.0  # no more sensitive than the default heartbeat_timeout
    warmup_steps: int = Field(20, ge=1, strict=True)


class Detection(BaseModel):
    """Thresholds of the watcher; a ``null`` rule section turns that rule off."""

    model_config = FROZEN

    poll_interval: Duration = 0.5
    startup_timeout: Duration = 120.0
    heartbeat_timeout: Duration = 2.0
    hang_timeout: Duration = 3.0
    # null: hang_timeout as written; a section: a derived, shorter threshold for fast jobs
    derive_hang_timeout: HangFromStepTime | None = None
    checkpoint_timeout: Duration = 120.0
    evidence_timeout: Duration = 2.0  # ranks' stacks and collective trace; silent ones skipped
    # A detected fault nobody handles this long (Airflow's scheduler down): stop it anyway.
    stop_unattended_after: Duration | None = 30.0
    straggler: StragglerDetection | None = StragglerDetection()
    throughput: ThroughputDetection | None = ThroughputDetection()
    nan_loss: bool = True

    @field_validator(*_DURATIONS, mode="after")
    @classmethod
    def _positive(cls, seconds: float | None) -> float | None:
        if seconds is not None and seconds <= 0:
            raise ValueError(f"expected a duration > 0 such as 2s, found {seconds:g}s")
        return seconds


class Policy(BaseModel):
    """A recovery policy: how faults are detected and what is done about each kind."""

    model_config = FROZEN

    version: int = Field(1, ge=1)
    description: str = ""
    mode: Mode = Mode.ENFORCE
    detection: Detection = Detection()
    rules: Rules
    max_attempts_per_segment: int = Field(8, ge=1, strict=True)
    nodes: NodeRules = NodeRules()
    escalation: Escalation = Escalation()


FIXES = {
    "detection.heartbeat_timeout": "set a few heartbeat intervals, e.g. heartbeat_timeout: 2s",
    "detection.hang_timeout": "set it above the slowest normal step, e.g. hang_timeout: 3s",
    "detection.startup_timeout": "allow for importing torch, e.g. startup_timeout: 2m",
    "detection.derive_hang_timeout.safety_factor": "use a factor of at least 2 over the "
    "p95 step time, e.g. safety_factor: 10",
    "detection.derive_hang_timeout.min": "set the shortest threshold a derivation may pick, "
    "above a heartbeat interval plus a poll, e.g. min: 1.5s",
    "detection.straggler.ratio": "use a ratio above 1, e.g. ratio: 1.5 (50% slower)",
    "detection.straggler.lost_seconds": "set how long the job may wait on a slow rank before it "
    "is called a straggler, above 0, e.g. lost_seconds: 1s (null: sustained alone)",
    "detection.throughput.floor": "use a fraction of the baseline, e.g. floor: 0.6",
    **{
        f"rules.{kind}": f"say what happens on {kind}, e.g. {kind}: "
        "{action: restart_elsewhere, max_attempts: 3, quarantine: 30m}"
        for kind in ("hang", "rank_unresponsive", "node_unresponsive", "straggler", "crash",
                     "launch_failure")
    },
    "rules.throughput_degraded": "e.g. throughput_degraded: {action: checkpoint_and_migrate}",
    "rules.nan_loss": "e.g. nan_loss: {action: rollback, max_attempts: 2}",
    "rules.corrupt_checkpoint": "e.g. corrupt_checkpoint: {action: rollback}",
    "rules.short_segment": "e.g. short_segment: {action: abort} (a retry would end as "
    "early; only abort or escalate)",
    "rules.preempted": "e.g. preempted: {action: checkpoint_and_migrate, max_attempts: 5} (no "
    "quarantine: the node is healthy)",
    "escalation.timeout": "bound one delivery try to at most a minute, e.g. timeout: 10s",
}


@dataclass(frozen=True)
class LoadedPolicy:
    """A validated policy with where it came from and its sha256 (carried on every decision)."""

    policy: Policy
    path: Path
    sha256: str


def load_policy(path: Path) -> LoadedPolicy:
    """Load and validate a policy file; raise ConfigError listing every problem."""
    raw, lines = load_yaml_with_lines(path)
    policy = validate_model(Policy, raw, lines, path, FIXES)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return LoadedPolicy(policy=policy, path=path, sha256=digest)


__all__ = ["ConfigError", "Detection", "LoadedPolicy", "Policy", "load_policy"]
