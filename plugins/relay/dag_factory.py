"""Turn job specs into DAGs: ``preflight >> segment_000 >> ... >> finalize``.

Called from the thin files in ``dags/``. A valid spec becomes a DAG; an invalid
one is reported by :func:`raise_for_invalid_specs` as an Airflow import error
of its own file, so one bad spec never hides the good jobs.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, Param, chain

from relay import settings
from relay.operators import FinalizeOperator, PreflightOperator, TrainSegmentOperator
from relay.spec import JobSpec, load_job_specs
from relay.yamlsource import ConfigError

CHAOS_PARAM_DOC = (
    "Faults to inject (tests and demos), e.g. "
    '[{"kind": "crash", "segment": 1, "step": 75, "rank": 1, "attempt": 1}]'
)


def build_dag(spec: JobSpec, spec_file: Path) -> DAG:
    """Build the DAG of one job."""
    doc = (
        f"### Relay job `{spec.job}`\n\n{spec.description}\n\n"
        f"- spec: `{spec_file}`\n- {spec.total_steps} steps in {len(spec.segments)} segments, "
        f"checkpoint every {spec.checkpoint_every} steps\n"
        f"- {spec.nodes} nodes x {spec.ranks_per_node} ranks, seed {spec.seed}\n"
    )
    with DAG(
        dag_id=spec.dag_id,
        description=spec.description or f"Relay training job {spec.job}",
        doc_md=doc,
        schedule=None,
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        tags=["relay", f"job:{spec.job}"],
        params={"chaos": Param([], type="array", description=CHAOS_PARAM_DOC)},
        default_args={
            "retries": spec.retries,
            "retry_delay": timedelta(seconds=spec.retry_delay),
        },
    ) as dag:
        common = {"spec_file": str(spec_file)}
        preflight = PreflightOperator(task_id="preflight", retries=0, **common)
        segments = [
            TrainSegmentOperator(task_id=f"segment_{index:03d}", segment=index, **common)
            for index, _start, _end in spec.segments
        ]
        finalize = FinalizeOperator(task_id="finalize", **common)
        chain(preflight, *segments, finalize)
    return dag


def job_dags(folder: Path | None = None) -> dict[str, DAG]:
    """Return a DAG for every valid job spec in ``folder`` (default: the jobs folder)."""
    specs, _errors = load_job_specs(folder or settings.jobs_dir())
    return {spec.dag_id: build_dag(spec, path) for path, spec in specs.items()}


class InvalidJobSpecError(Exception):
    """One or more job specs could not be turned into DAGs."""


def raise_for_invalid_specs(folder: Path | None = None) -> None:
    """Raise one error listing every invalid spec (file:line, field, fix), if any."""
    _specs, errors = load_job_specs(folder or settings.jobs_dir())
    if errors:
        raise InvalidJobSpecError(format_spec_errors(errors))


def format_spec_errors(errors: dict[Path, ConfigError]) -> str:
    """Return a readable report of invalid specs; the other jobs still load."""
    lines = [f"{len(errors)} Relay job spec(s) are invalid and were not loaded:"]
    lines += [str(err) for err in errors.values()]
    lines.append("Every other job spec in the folder was loaded as usual.")
    return "\n".join(lines)
