"""``checkpoint_every: auto``: each attempt's checkpoint interval from Young/Daly.

Young's optimum (Daly's, to first order while a checkpoint costs far less than
the time between faults) balances the time spent checkpointing against the work
a fault throws away::

    interval = sqrt(2 x checkpoint cost x mean time between faults)

The inputs come from the job's own record in MLflow (every DAG run of the job,
this one included, its newest :data:`HISTORY_ATTEMPTS` segment attempts):

- checkpoint cost: the stall the training loop sees for one async save (rank 0
  logs ``checkpoint_stall_seconds`` at each save), the median over the attempts.
  It leaves out how much slower steps run while the save is written beside them
  (`relay bench checkpoint` measures that). None measured yet:
  :data:`DEFAULT_CHECKPOINT_COST_SECONDS`.
- mean time between faults: the attempts' wall time divided by the faults they
  met (attempts tagged ``relay.fault_kind``). No fault yet: that time, or
  :data:`DEFAULT_MTBF_SECONDS` while it is shorter (a clean hour says little).
- seconds per step: the median of the attempts' ``step_seconds`` metric, to turn
  seconds into steps. None measured yet (the job's first attempt): the interval
  is ``steps_per_segment / FALLBACK_CHECKPOINTS_PER_SEGMENT``.

The result is rounded to whole steps and held within the spec's ``min`` and
``max``. The choice and every input are recorded per attempt: the attempt's
MLflow params ``checkpoint_every`` and ``checkpoint_every_reason``, the launch
file's ``checkpoint_every``, and ``checkpoint_interval.json`` in the attempt folder.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relay.core.attempt import INTERVAL_FILE
from relay.spec.job import JobSpec
from relay_train.protocol.heartbeat import write_atomically

DEFAULT_CHECKPOINT_COST_SECONDS = 1.0  # until the job's own async saves are measured
DEFAULT_MTBF_SECONDS = 24 * 3600.0  # one fault a day: a common planning figure for a node pool
FALLBACK_CHECKPOINTS_PER_SEGMENT = 4  # the first attempt's interval, before any step is timed
HISTORY_ATTEMPTS = 200  # the newest segment attempts of the job that count
STALL_METRIC = "checkpoint_stall_seconds"  # logged by rank 0 at each save (relay_train.api)
STEP_METRIC = "step_seconds"  # rank 0's moving average of one step's wall time


@dataclass(frozen=True)
class JobHistory:
    """What the job's earlier attempts tell about its checkpoints, faults and pace."""

    attempts: int = 0
    exposure_seconds: float = 0.0  # the attempts' wall time, summed
    faults: int = 0
    stall_seconds: list[float] = field(default_factory=list)  # one per attempt that saved
    step_seconds: list[float] = field(default_factory=list)  # one per attempt that stepped


@dataclass(frozen=True)
class IntervalChoice:
    """The interval one attempt checkpoints at, and why."""

    steps: int
    mode: str  # "fixed" (a number in the spec) or "auto"
    reason: str
    bounds: tuple[int, int] | None = None
    bound_hit: str | None = None  # "min" or "max" when a bound decided it
    checkpoint_cost_seconds: float | None = None
    checkpoint_cost_source: str | None = None
    mtbf_seconds: float | None = None
    mtbf_source: str | None = None
    step_seconds: float | None = None
    step_source: str | None = None
    young_daly_seconds: float | None = None
    unbounded_steps: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """Return the record written to checkpoint_interval.json."""
        return {"formula": "sqrt(2 x checkpoint cost x MTBF)" if self.mode == "auto" else None,
                **asdict(self)}

    def params(self) -> dict[str, str]:
        """Return the attempt's MLflow params (MLflow keeps values up to 6,000 characters)."""
        return {"checkpoint_every": str(self.steps), "checkpoint_every_reason": self.reason[:5000]}

    def record(self, attempt_dir: Path) -> None:
        """Write the choice next to the attempt's launch file."""
        attempt_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(attempt_dir / INTERVAL_FILE, json.dumps(self.to_dict(), indent=2))


def young_daly_seconds(checkpoint_cost: float, mtbf: float) -> float:
    """Return Young's optimal seconds between checkpoints: sqrt(2 C M)."""
    if checkpoint_cost < 0 or mtbf <= 0:
        raise ValueError(f"expected a cost >= 0 and an MTBF > 0, found {checkpoint_cost}, {mtbf}")
    return math.sqrt(2.0 * checkpoint_cost * mtbf)


def bounded(steps: int, low: int, high: int) -> tuple[int, str | None]:
    """Return ``steps`` held within [low, high] and which bound, if any, it hit."""
    if steps < low:
        return low, "min"
    if steps > high:
        return high, "max"
    return steps, None


def _seconds(value: float) -> str:
    return f"{value / 3600:.1f}h" if value >= 3600 else f"{value:.3g}s"


def _cost(history: JobHistory) -> tuple[float, str]:
    if history.stall_seconds:
        n = len(history.stall_seconds)
        return statistics.median(history.stall_seconds), f"median stall of {n} attempt(s)"
    return DEFAULT_CHECKPOINT_COST_SECONDS, "default (no save measured yet)"


def _mtbf(history: JobHistory) -> tuple[float, str]:
    seen = f"{history.faults} fault(s) in {_seconds(history.exposure_seconds)} of " \
           f"{history.attempts} attempt(s)"
    if history.faults:
        return history.exposure_seconds / history.faults, seen
    if history.exposure_seconds >= DEFAULT_MTBF_SECONDS:
        return history.exposure_seconds, seen + ": at least that"
    return DEFAULT_MTBF_SECONDS, seen + ": default"


def choose_interval(spec: JobSpec, history: JobHistory) -> IntervalChoice:
    """Return the interval for the next attempt of ``spec`` given the job's history."""
    if spec.checkpoint_auto is None:
        steps = int(spec.checkpoint_every)  # type: ignore[arg-type]
        return IntervalChoice(steps, "fixed", f"fixed: checkpoint_every {steps} in the spec")
    low, high = spec.checkpoint_bounds
    cost, cost_source = _cost(history)
    mtbf, mtbf_source = _mtbf(history)
    seconds = young_daly_seconds(cost, mtbf)
    inputs = (f"cost {_seconds(cost)} ({cost_source}), MTBF {_seconds(mtbf)} ({mtbf_source})")
    common = {"bounds": (low, high), "checkpoint_cost_seconds": round(cost, 6),
              "checkpoint_cost_source": cost_source, "mtbf_seconds": round(mtbf, 3),
              "mtbf_source": mtbf_source, "young_daly_seconds": round(seconds, 3)}
    if not history.step_seconds:
        unbounded = max(spec.steps_per_segment // FALLBACK_CHECKPOINTS_PER_SEGMENT, 1)
        steps, hit = bounded(unbounded, low, high)
        reason = (f"auto: {steps} steps; no step time measured yet, so steps_per_segment / "
                  f"{FALLBACK_CHECKPOINTS_PER_SEGMENT} = {unbounded}"
                  + (f", held at the {hit} bound" if hit else "")
                  + f" (Young/Daly would be {_seconds(seconds)}: {inputs})")
        return IntervalChoice(steps, "auto", reason, bound_hit=hit, unbounded_steps=unbounded,
                              step_source="not measured yet", **common)
    step = statistics.median(history.step_seconds)
    unbounded = max(round(seconds / step), 1) if step > 0 else high
    steps, hit = bounded(unbounded, low, high)
    reason = (f"auto: {steps} steps = sqrt(2 x {inputs}) = {_seconds(seconds)} / "
              f"{step:.4g}s per step (median of {len(history.step_seconds)} attempt(s)) "
              f"= {unbounded} steps" + (f", held at the {hit} bound {steps}" if hit else "")
              + f"; bounds {low}..{high}")
    return IntervalChoice(steps, "auto", reason, bound_hit=hit, step_seconds=round(step, 6),
                          step_source=f"median of {len(history.step_seconds)} attempt(s)",
                          unbounded_steps=unbounded, **common)


def read_history(lineage: Any, job: str, now: float | None = None) -> JobHistory:  # noqa: ANN401
    """Read the job's newest segment attempts from MLflow (every DAG run of the job)."""
    from relay.lineage.store import TAG_FAULT, TAG_SEGMENT

    experiment = lineage.client.get_experiment_by_name(f"relay/{job}")  # Lineage's naming
    if experiment is None:
        return JobHistory()
    runs = lineage.client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`{TAG_SEGMENT}` != ''",
        order_by=["attributes.start_time DESC"], max_results=HISTORY_ATTEMPTS)
    now = time.time() if now is None else now
    exposure, faults, stalls, steps = 0.0, 0, [], []
    for run in runs:
        ended = run.info.end_time / 1000 if run.info.end_time else now
        exposure += max(ended - run.info.start_time / 1000, 0.0)
        faults += 1 if run.data.tags.get(TAG_FAULT) else 0
        metrics = run.data.metrics  # each metric's latest value
        if metrics.get(STALL_METRIC) is not None:
            stalls.append(float(metrics[STALL_METRIC]))
        if metrics.get(STEP_METRIC):
            steps.append(float(metrics[STEP_METRIC]))
    return JobHistory(len(runs), exposure, faults, stalls, steps)


def interval_for(spec: JobSpec, lineage: Any) -> IntervalChoice:  # noqa: ANN401
    """Return the next attempt's interval; a fixed one needs no MLflow round-trip."""
    if spec.checkpoint_auto is None:
        return choose_interval(spec, JobHistory())
    return choose_interval(spec, read_history(lineage, spec.job))


def explain_text(spec: JobSpec, choice: IntervalChoice | None = None) -> str:
    """Return, in plain sentences, how ``spec`` sets its checkpoint interval."""
    if spec.checkpoint_auto is None:
        return f"Checkpoints: every {spec.checkpoint_every} steps (fixed in the spec)."
    low, high = spec.checkpoint_bounds
    lines = [
        f"Checkpoints: checkpoint_every is auto. Before each attempt Relay sets the interval to "
        f"sqrt(2 x checkpoint cost x mean time between faults) (Young/Daly), in steps at the "
        f"job's measured seconds per step, held within {low}..{high} steps.",
        f"  checkpoint cost: the median stall of an async save in the job's last "
        f"{HISTORY_ATTEMPTS} attempts (MLflow metric {STALL_METRIC}); none yet: "
        f"{_seconds(DEFAULT_CHECKPOINT_COST_SECONDS)}.",
        f"  mean time between faults: those attempts' wall time / their faults; no fault yet: "
        f"at least {_seconds(DEFAULT_MTBF_SECONDS)}.",
        f"  before any step is timed (the job's first attempt): steps_per_segment / "
        f"{FALLBACK_CHECKPOINTS_PER_SEGMENT}, within the bounds.",
    ]
    if choice is not None:
        lines.append(f"  An attempt starting now: {choice.reason}.")
    return "\n".join(lines)
