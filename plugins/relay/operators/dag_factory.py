"""Turn job specs into DAGs: ``preflight >> segment_000 >> ... >> finalize``.

Called from the thin files in ``dags/``. A valid spec becomes a DAG; an invalid
one is reported by :func:`raise_for_invalid_specs` as an Airflow import error
of its own file, so one bad spec never hides the good jobs.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, Param, chain

from relay.core import settings
from relay.core.exceptions import ConfigError, InvalidJobSpecError
from relay.operators.base import FinalizeOperator, PreflightOperator
from relay.operators.callbacks import CloseParentRunOnFailure
from relay.operators.retry import PolicyRetry
from relay.operators.segment import TrainSegmentOperator
from relay.policy.model import load_policy
from relay.spec.chaos_conf import CHAOS_EXAMPLE, CHAOS_ITEMS
from relay.spec.job import JobSpec, load_job_specs

CHAOS_PARAM_DOC = (
    f"Faults to inject (only if the job spec says `chaos: allowed`), e.g. {CHAOS_EXAMPLE}"
)


def build_dag(spec: JobSpec, spec_file: Path) -> DAG:
    """Build the DAG of one job (a policy that does not load is an import error)."""
    policy = load_policy(spec.policy_path(spec_file))
    doc = (
        f"### Relay job `{spec.job}`\n\n{spec.description}\n\n"
        f"- spec: `{spec_file}`\n- {spec.total_steps} steps in {len(spec.segments)} segments, "
        f"checkpoint_every {spec.checkpoint_every_text()}\n"
        f"- {spec.nodes} nodes x {spec.ranks_per_node} ranks, seed {spec.seed}\n"
        f"- recovery policy `{policy.path}` (sha256 `{policy.sha256[:12]}`): "
        "`relay policy explain` tells what it does\n"
    )
    close_parent = CloseParentRunOnFailure(spec.job)
    with DAG(
        dag_id=spec.dag_id,
        description=spec.description or f"Relay training job {spec.job}",
        doc_md=doc,
        schedule=None,
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        tags=["relay", f"job:{spec.job}"],
        params={"chaos": Param([], type="array", items=CHAOS_ITEMS,
                               description=CHAOS_PARAM_DOC)},
        default_args={
            "retries": spec.retries,
            "retry_delay": timedelta(seconds=spec.retry_delay),
            "on_failure_callback": close_parent,
        },
        on_failure_callback=close_parent,
    ) as dag:
        common = {"spec_file": str(spec_file)}
        preflight = PreflightOperator(task_id="preflight", retries=0, **common)
        # The policy decides retries: Airflow may try a segment as often as the policy
        # allows, and PolicyRetry turns each decision into Airflow's retry or fail.
        segments = [
            TrainSegmentOperator(
                task_id=f"segment_{index:03d}", segment=index,
                retries=policy.policy.max_attempts_per_segment - 1,
                retry_policy=PolicyRetry(), **common,
            )
            for index, _start, _end in spec.segments
        ]
        finalize = FinalizeOperator(task_id="finalize", **common)
        chain(preflight, *segments, finalize)
    return dag


def _checked_specs(folder: Path | None) -> tuple[dict[Path, JobSpec], dict[Path, ConfigError]]:
    """Load every spec and its policy; a spec whose policy is invalid counts as invalid."""
    specs, errors = load_job_specs(folder or settings.jobs_dir())
    for path, spec in list(specs.items()):
        try:
            load_policy(spec.policy_path(path))
        except ConfigError as err:
            del specs[path]
            errors[path] = err
    return specs, errors


def job_dags(folder: Path | None = None) -> dict[str, DAG]:
    """Return a DAG for every valid job spec (with a valid policy) in ``folder``."""
    specs, _errors = _checked_specs(folder)
    return {spec.dag_id: build_dag(spec, path) for path, spec in specs.items()}


def raise_for_invalid_specs(folder: Path | None = None) -> None:
    """Raise one error listing every invalid spec or policy (file:line, field, fix), if any."""
    _specs, errors = _checked_specs(folder)
    if errors:
        raise InvalidJobSpecError(format_spec_errors(errors))


def format_spec_errors(errors: dict[Path, ConfigError]) -> str:
    """Return a readable report of invalid specs; the other jobs still load."""
    lines = [f"{len(errors)} Relay job spec(s) are invalid (or name an invalid policy) and were "
             "not loaded:"]
    lines += [str(err) for err in errors.values()]
    lines.append("Every other job spec in the folder was loaded as usual.")
    return "\n".join(lines)
