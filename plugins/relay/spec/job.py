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


FIXES: dict[str, str] = {
    "job": (
        "set job to a lowercase name of letters, digits, '-' or '_' that starts with a "
        "letter or digit, at most 63 characters, e.g. job: demo"
    ),
    "description": 'set description to text in quotes, e.g. description: "Nightly char model"',
    "seed": "set seed to a whole number >= 0, e.g. seed: 1234",
    "total_steps": "set total_steps to a whole number of steps > 0, e.g. total_steps: 240, "
    "or give epochs and steps_per_epoch instead (e.g. epochs: 4 / steps_per_epoch: 60)",
    "epochs": "set epochs to a whole number of passes over the data > 0, with "
    "steps_per_epoch, e.g. epochs: 4",
    "steps_per_epoch": "set steps_per_epoch to the number of batches in one epoch of the "
    "script's DataLoader on each rank (len(loader)), a whole number > 0, e.g. "
    "steps_per_epoch: 60",
    "steps_per_segment": (
        "set steps_per_segment to a whole number of steps > 0, e.g. steps_per_segment: 60"
    ),
    "checkpoint_every": (
        "set checkpoint_every to a whole number of steps > 0 and no more than "
        "steps_per_segment (e.g. checkpoint_every: 20), or to auto (Relay picks it from the "
        "job's checkpoint cost and fault history; e.g. checkpoint_every: {auto: true, min: 10, "
        "max: 60})"
    ),
    "checkpoint_every.auto": "write auto: true, or give checkpoint_every a number of steps",
    "checkpoint_every.min": (
        "set checkpoint_every.min to the fewest steps between checkpoints, a whole number "
        ">= 1, e.g. min: 10"
    ),
    "checkpoint_every.max": (
        "set checkpoint_every.max to the most steps between checkpoints, a whole number "
        "from min to steps_per_segment, e.g. max: 60"
    ),
    "nodes": "set nodes to a whole number of simulated nodes >= 1, e.g. nodes: 2",
    "ranks_per_node": "set ranks_per_node to a whole number >= 1, e.g. ranks_per_node: 2",
    "model": "write model as a mapping, e.g. model: {d_model: 64, n_heads: 4}",
    "model.context": "set model.context to a whole number of characters >= 2, e.g. context: 64",
    "model.d_model": "set model.d_model to a multiple of model.n_heads, e.g. d_model: 64",
    "model.n_layers": "set model.n_layers to a whole number >= 1, e.g. n_layers: 2",
    "model.n_heads": "set model.n_heads to a whole number >= 1 dividing d_model, e.g. n_heads: 4",
    "model.dropout": "set model.dropout to a number from 0 up to (not including) 1, e.g. 0.1",
    "data": "write data as a mapping, e.g. data: {corpus: builtin:python_docs, batch_size: 16}",
    "data.corpus": (
        "set data.corpus to builtin:<name> (e.g. builtin:python_docs) or a path to a text file"
    ),
    "data.batch_size": "set data.batch_size to a whole number >= 1, e.g. batch_size: 16",
    "optimizer": "write optimizer as a mapping, e.g. optimizer: {lr: 0.003, weight_decay: 0.01}",
    "optimizer.lr": "set optimizer.lr to a number > 0, e.g. lr: 0.003",
    "optimizer.weight_decay": "set optimizer.weight_decay to a number >= 0, e.g. 0.01",
    "policy": (
        "set policy to the name of a file in the policies folder (e.g. policy: default) "
        "or to a path ending in .yaml relative to this spec's folder"
    ),
    "retries": "set retries to a whole number >= 0, e.g. retries: 2",
    "retry_delay": "set retry_delay to a duration such as 2s, 500ms or 1m, e.g. retry_delay: 2s",
    "collective_timeout": (
        "set collective_timeout to a duration > 0 such as 30m or 1h, e.g. collective_timeout: 30m"
    ),
    "entrypoint": (
        "write entrypoint as a mapping with module or script, e.g. entrypoint: "
        "{module: mypkg.train, args: [--lr, '3e-4']} or entrypoint: {script: train.py}"
    ),
    "entrypoint.module": "set entrypoint.module to a dotted module name, e.g. mypkg.train",
    "entrypoint.script": "set entrypoint.script to a Python file, relative to this spec's folder",
    "entrypoint.args": "write entrypoint.args as a list of strings, e.g. args: [--lr, '3e-4']",
    "entrypoint.workdir": "set entrypoint.workdir to the ranks' working directory, relative "
    "to this spec's folder or absolute, e.g. workdir: .",
    "entrypoint.env": "write entrypoint.env as a mapping of variable names to quoted text, "
    'e.g. env: {HF_HOME: /data/hf, TOKENIZERS_PARALLELISM: "false"}',
    "heartbeat_interval": (
        "set heartbeat_interval to a duration > 0 such as 0.5s or 500ms, "
        "e.g. heartbeat_interval: 0.5s"
    ),
    "backend": (
        "set backend to auto (NCCL when every rank of a node gets a GPU, else gloo), "
        "gloo or nccl, e.g. backend: auto"
    ),
    "deterministic": (
        "set deterministic to true (bit-exact resume; deterministic GPU kernels) or false"
    ),
    "chaos": (
        "set chaos: allowed to let DAG runs inject faults (test and demo jobs only), or remove "
        "the line (the default, forbidden)"
    ),
    "segment_boundary": "set segment_boundary to adopt (the next segment takes over the "
    "running workload at the boundary checkpoint) or restart (a fresh launch per segment)",
    "launcher": "set launcher to local (processes on this machine), kubernetes (a Job per "
    "segment attempt) or slurm (a Slurm job per segment attempt), e.g. launcher: local",
    "slurm": "write slurm as a mapping, e.g. slurm: {node_home: '/var/tmp/relay/{node}', "
    "python: /opt/relay/bin/python} (see docs/slurm.md)",
    "kubernetes": "write kubernetes as a mapping, e.g. kubernetes: {image: "
    "registry.example.com/relay-worker:0.1.0, namespace: relay}",
    "kubernetes.image": "set kubernetes.image to the worker image the pods run, e.g. "
    "image: registry.example.com/relay-worker:0.1.0 (built from deploy/worker.Dockerfile)",
    "kubernetes.namespace": "set kubernetes.namespace to a namespace name (lowercase letters, "
    "digits, '-'), e.g. namespace: relay",
    "kubernetes.service_account": "set kubernetes.service_account to the pods' service account "
    "(lowercase letters, digits, '-'), e.g. service_account: relay-worker",
    "kubernetes.gpus_per_pod": "set kubernetes.gpus_per_pod to a whole number >= 0 (0: CPU "
    "only), e.g. gpus_per_pod: 8",
    "kubernetes.active_deadline": "set kubernetes.active_deadline to a duration > 0 that one "
    "segment attempt may not outlive, e.g. active_deadline: 6h",
    "kubernetes.taint_quarantine": "set kubernetes.taint_quarantine to true (quarantined nodes "
    "also get a NoSchedule taint; needs RBAC to patch nodes) or false",
    "kubernetes.cpu": "set kubernetes.cpu to each pod's CPUs as a Kubernetes quantity "
    "(requested and limited), e.g. cpu: 8 or cpu: 500m",
    "kubernetes.memory": "set kubernetes.memory to each pod's memory as a Kubernetes quantity "
    "(requested and limited), e.g. memory: 64Gi",
    "kubernetes.airflow_namespace": "set kubernetes.airflow_namespace to the namespace of "
    "Airflow's workers and triggerer (the only pods let in to the agents' port), e.g. "
    "airflow_namespace: airflow",
}

EMPTY_FIX = (
    "add at least job, total_steps, steps_per_segment and checkpoint_every, e.g. "
    "job: demo / total_steps: 240 / steps_per_segment: 60 / checkpoint_every: 20 "
    "(one per line)"
)


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
