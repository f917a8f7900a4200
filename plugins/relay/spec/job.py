"""The training job spec: one YAML file per job, validated with file:line problems.

Imports neither Airflow nor torch, so the DAG file, the operators and the CLI
can all load specs cheaply. Every problem in a spec is reported at once, each
with the line of the offending key and a concrete fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from relay.core.exceptions import ConfigError
from relay.spec.checkpoint_spec import AutoInterval, CheckpointEvery, auto_bounds, auto_shorthand
from relay.spec.job_fixes import EMPTY_FIX, FIXES
from relay.spec.policy_files import (
    DEFAULT_POLICY,
    POLICY_NAME,
    YAML_SUFFIXES,
    missing_policy_problem,
    resolve_policy,
)
from relay.spec.sections import (
    DataSpec,
    EntrypointSpec,
    KubernetesSpec,
    ModelSpec,
    OptimizerSpec,
)
from relay.spec.slurm import SlurmSpec
from relay.spec.validation_problems import model_problems
from relay.spec.yamlsource import (
    FROZEN,
    FieldValueError,
    KeyPath,
    Problem,
    line_for,
    load_yaml_with_lines,
    parse_duration,
)
from relay_train.protocol.launch import BUILTIN_ENTRYPOINT, Entrypoint

JOB_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"

class JobSpec(BaseModel):
    """One training job: what to train, how to cut it into segments, how to recover."""

    model_config = FROZEN

    job: str = Field(strict=True, pattern=JOB_NAME_PATTERN)
    description: str = Field("", strict=True)
    seed: int = Field(0, strict=True, ge=0)
    # epochs x steps_per_epoch stands in for total_steps (a step is one batch of the
    # script's DataLoader: steps_per_epoch is len(loader), checked by session.batches).
    epochs: int | None = Field(None, strict=True, gt=0)
    steps_per_epoch: int | None = Field(None, strict=True, gt=0, validate_default=True)
    total_steps: int = Field(None, strict=True, gt=0, validate_default=True)  # type: ignore[assignment]
    steps_per_segment: int = Field(strict=True, gt=0)
    checkpoint_every: CheckpointEvery  # steps, or auto (relay.lineage.interval)
    nodes: int = Field(2, strict=True, ge=1)
    ranks_per_node: int = Field(2, strict=True, ge=1)
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    policy: str = Field(DEFAULT_POLICY, strict=True)
    retries: int = Field(2, strict=True, ge=0)
    retry_delay: float = Field(2.0, ge=0)
    collective_timeout: float = Field(1800.0, gt=0)
    heartbeat_interval: float = Field(0.5, gt=0)
    entrypoint: EntrypointSpec | None = None
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # see training/device.py
    deterministic: bool = Field(True, strict=True)  # bit-exact resume (deterministic GPU kernels)
    chaos: Literal["allowed", "forbidden"] = "forbidden"
    launcher: Literal["local", "kubernetes", "slurm"] = "local"
    # adopt: a segment's workload trains on past its end and the next segment's task adopts
    # it (relay.launchers.local.adopt); restart: every segment launches a fresh workload.
    segment_boundary: Literal["adopt", "restart"] = "adopt"
    kubernetes: KubernetesSpec | None = Field(None, validate_default=True)
    slurm: SlurmSpec | None = None  # launcher: slurm (its defaults when left out)

    @field_validator("steps_per_epoch")
    @classmethod
    def _epoch_length(cls, value: int | None, info: ValidationInfo) -> int | None:
        """Require steps_per_epoch with epochs: Relay cannot open the script's DataLoader."""
        if value is None and info.data.get("epochs") is not None:
            raise FieldValueError(
                "steps_per_epoch (batches per epoch: len(loader) on each rank) with epochs",
                None, "add steps_per_epoch: the number of batches of one epoch of the "
                "script's DataLoader on each rank, e.g. steps_per_epoch: 50 (or replace "
                "epochs with total_steps)", shown="nothing")
        return value

    @field_validator("total_steps", mode="before")
    @classmethod
    def _total_or_epochs(cls, value: object, info: ValidationInfo) -> object:
        """Derive total_steps from epochs x steps_per_epoch; refuse a count that disagrees."""
        if "epochs" not in info.data or "steps_per_epoch" not in info.data:
            # epochs or steps_per_epoch is wrong, and reported on its own line; the spec is
            # refused anyway, so a missing total_steps adds no second, misleading problem.
            return 1 if value is None else value
        epochs, per_epoch = info.data["epochs"], info.data["steps_per_epoch"]
        if epochs is None:
            if value is None:
                raise FieldValueError("this field to be set (or epochs with steps_per_epoch)",
                                      None, FIXES["total_steps"], shown="nothing")
            return value
        derived = epochs * per_epoch
        if value is not None and value != derived:
            raise FieldValueError(
                f"epochs x steps_per_epoch = {epochs} x {per_epoch} = {derived} steps", value,
                f"remove total_steps (epochs decides it), or set total_steps: {derived}")
        return derived

    @field_validator("retry_delay", "collective_timeout", "heartbeat_interval", mode="before")
    @classmethod
    def _duration(cls, value: object) -> float:
        """Parse "500ms", "30s", "5m", "1h30m" or a number of seconds."""
        return parse_duration(value)

    @field_validator("checkpoint_every", mode="before")
    @classmethod
    def _auto_word(cls, value: object) -> object:
        return auto_shorthand(value, FIXES["checkpoint_every"])

    @field_validator("checkpoint_every")
    @classmethod
    def _within_segment(cls, value: int | AutoInterval, info: ValidationInfo) -> int | AutoInterval:
        """Require at least one checkpoint inside every full segment."""
        per_segment = info.data.get("steps_per_segment")
        if isinstance(value, AutoInterval):
            return auto_bounds(value, per_segment)
        if isinstance(per_segment, int) and value > per_segment:
            raise FieldValueError(
                f"a number of steps <= steps_per_segment ({per_segment})",
                value,
                f"lower checkpoint_every to at most {per_segment} (e.g. checkpoint_every: "
                f"{per_segment}), or raise steps_per_segment "
                f"to at least {value}",
            )
        return value

    @field_validator("launcher")
    @classmethod
    def _paths_in_the_pods(cls, value: str, info: ValidationInfo) -> str:
        """On Kubernetes, the ranks see the image, not the spec's folder: a script, working
        folder or corpus file must be an absolute path there (or a module, a builtin)."""
        if value != "kubernetes":
            return value
        entry, data = info.data.get("entrypoint"), info.data.get("data")
        named = {"entrypoint.script": entry and entry.script,
                 "entrypoint.workdir": entry and entry.workdir,
                 "data.corpus": data and not data.corpus.startswith("builtin:") and data.corpus}
        for field, path in named.items():
            if path and not Path(path).is_absolute():
                raise FieldValueError(
                    f"{field} as an absolute path inside the worker image with launcher: "
                    "kubernetes (the pods do not have the spec's folder)", path,
                    f"write {field} as the path the image holds it at (e.g. /app/{path}), "
                    "or use entrypoint.module of a package installed in the image")
        return value

    @field_validator("kubernetes")
    @classmethod
    def _kubernetes_when_used(
        cls, value: KubernetesSpec | None, info: ValidationInfo
    ) -> KubernetesSpec | None:
        """Require the kubernetes section when the launcher is kubernetes."""
        if value is None and info.data.get("launcher") == "kubernetes":
            raise FieldValueError(
                "a kubernetes section when launcher is kubernetes", None,
                "add kubernetes: {image: REGISTRY/relay-worker:TAG} (see docs/kubernetes.md), "
                "or set launcher: local",
            )
        return value

    @field_validator("policy")
    @classmethod
    def _policy_reference(cls, value: str) -> str:
        """Accept a policy name or a path ending in .yaml/.yml."""
        if value.endswith(YAML_SUFFIXES) or POLICY_NAME.fullmatch(value):
            return value
        raise FieldValueError("a policy name such as default, or a path ending in .yaml", value)

    @property
    def checkpoint_auto(self) -> AutoInterval | None:
        """Return the bounds when Relay picks the checkpoint interval, else None."""
        return self.checkpoint_every if isinstance(self.checkpoint_every, AutoInterval) else None

    @property
    def checkpoint_bounds(self) -> tuple[int, int]:
        """Return the (min, max) steps ``auto`` may choose (a fixed interval: itself twice)."""
        auto = self.checkpoint_auto
        if auto is None:
            return int(self.checkpoint_every), int(self.checkpoint_every)  # type: ignore[arg-type]
        return auto.min, auto.max if auto.max is not None else self.steps_per_segment

    def checkpoint_every_text(self) -> str:
        """Return the interval as a person reads it: ``20`` or ``auto (10..60 steps)``."""
        if self.checkpoint_auto is None:
            return str(self.checkpoint_every)
        low, high = self.checkpoint_bounds
        return f"auto ({low}..{high} steps)"

    @property
    def chaos_allowed(self) -> bool:
        """Return whether DAG runs of this job may inject faults (run conf ``chaos``)."""
        return self.chaos == "allowed"

    @property
    def dag_id(self) -> str:
        """Return the Airflow DAG id of this job."""
        return f"relay_{self.job}"

    @property
    def world_size(self) -> int:
        """Return the number of ranks in every segment."""
        return self.nodes * self.ranks_per_node

    @property
    def segments(self) -> list[tuple[int, int, int]]:
        """Return ``(index, start_step, end_step)`` for each segment; the last may be short."""
        starts = range(0, self.total_steps, self.steps_per_segment)
        return [
            (index, start, min(start + self.steps_per_segment, self.total_steps))
            for index, start in enumerate(starts)
        ]

    def launch_entrypoint(self, spec_file: Path) -> Entrypoint:
        """Return what the ranks run: the spec's entrypoint, or the built-in example."""
        if self.entrypoint is None:
            return Entrypoint(module=BUILTIN_ENTRYPOINT)
        return self.entrypoint.resolved(spec_file)

    def policy_path(self, spec_file: Path) -> Path:
        """Return the policy file this job uses, relative paths taken from the spec's folder."""
        return resolve_policy(self.policy, spec_file)


def _load(path: Path) -> tuple[JobSpec, dict[KeyPath, int]]:
    """Load and check one spec; return it with its line map or raise ConfigError."""
    raw, lines = load_yaml_with_lines(path, empty_fix=EMPTY_FIX)
    spec, problems = model_problems(JobSpec, raw, lines, path, FIXES)
    if not any(p.field == "policy" for p in problems):
        missing = missing_policy_problem(raw, lines, path)
        if missing is not None:
            problems.append(missing)
    if spec is None or problems:
        problems.sort(key=lambda p: p.line if p.line is not None else 0)
        raise ConfigError(problems, path)
    return spec, lines


def load_job_spec(path: Path) -> JobSpec:
    """Load one job spec; raise ConfigError listing every problem in it."""
    return _load(Path(path))[0]


def load_job_specs(folder: Path) -> tuple[dict[Path, JobSpec], dict[Path, ConfigError]]:
    """Load every ``*.yaml``/``*.yml`` spec in ``folder``; return good specs and errors."""
    files = sorted(
        p for p in Path(folder).iterdir() if p.suffix in YAML_SUFFIXES and p.is_file()
    )
    specs: dict[Path, JobSpec] = {}
    errors: dict[Path, ConfigError] = {}
    owners: dict[str, Path] = {}
    for path in files:
        try:
            spec, lines = _load(path)
        except ConfigError as exc:
            errors[path] = exc
            continue
        first = owners.get(spec.job)
        if first is not None:
            fix = (
                f"rename the job in this file (e.g. job: {spec.job[:60]}-2); "
                f"{spec.job!r} is already defined in {first}"
            )
            problem = Problem(str(path), line_for(lines, ("job",)), "job",
                              f"a job name not used by another spec (already used in {first.name})",
                              repr(spec.job), fix)
            errors[path] = ConfigError([problem], path)
            continue
        owners[spec.job] = path
        specs[path] = spec
    return specs, errors
