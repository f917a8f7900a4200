"""The sections of a job spec (:class:`relay.spec.job.JobSpec`): the built-in model, its data
and optimizer, a user's entrypoint, and where attempts run on Kubernetes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from relay.spec.yamlsource import FROZEN, FieldValueError, parse_duration
from relay_train.protocol.env import RESERVED_ENV
from relay_train.protocol.interpreter import interpreter_of
from relay_train.protocol.launch import Entrypoint

MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
# A label key: an optional DNS-subdomain prefix and "/", then a name of up to 63 characters.
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"
# A Kubernetes resource quantity as people write them: "4", "500m", "16Gi", "1.5".
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"


class ModelSpec(BaseModel):
    """Shape of the character transformer."""

    model_config = FROZEN

    context: int = Field(64, strict=True, ge=2)
    n_layers: int = Field(2, strict=True, ge=1)
    n_heads: int = Field(4, strict=True, ge=1)
    d_model: int = Field(64, strict=True, gt=0, validate_default=True)
    dropout: float = Field(0.1, strict=True, ge=0, lt=1)

    @field_validator("d_model")
    @classmethod
    def _divisible_by_heads(cls, value: int, info: ValidationInfo) -> int:
        """Require d_model to split evenly across the attention heads."""
        heads = info.data.get("n_heads")
        if isinstance(heads, int) and value % heads:
            up = (value // heads + 1) * heads
            divisor = max(h for h in range(1, heads + 1) if value % h == 0)
            raise FieldValueError(
                f"a multiple of model.n_heads ({heads})",
                value,
                f"set model.d_model to a multiple of {heads} (e.g. d_model: {up}), "
                f"or set model.n_heads to a divisor of {value} (e.g. n_heads: {divisor})",
            )
        return value


class DataSpec(BaseModel):
    """Where the training text comes from and how much of it one rank sees per step."""

    model_config = FROZEN

    corpus: str = Field("builtin:python_docs", strict=True, min_length=1)
    batch_size: int = Field(16, strict=True, ge=1)

    @field_validator("corpus")
    @classmethod
    def _builtin_name(cls, value: str) -> str:
        """A builtin corpus is a name, never a path out of the corpus folder."""
        if value.startswith("builtin:") and not re.fullmatch(r"builtin:[A-Za-z0-9_-]+", value):
            raise FieldValueError("builtin:<name> of letters, digits, '_' or '-'", value,
                                  "name a builtin corpus (e.g. builtin:python_docs), or give "
                                  "a path to a text file without the builtin: prefix")
        return value


class OptimizerSpec(BaseModel):
    """AdamW settings."""

    model_config = FROZEN

    lr: float = Field(0.003, strict=True, gt=0)
    weight_decay: float = Field(0.01, strict=True, ge=0)


class EntrypointSpec(BaseModel):
    """The training script each rank runs: a module or a file, with its arguments."""

    model_config = FROZEN

    module: str | None = Field(None, strict=True, pattern=MODULE_PATTERN)
    script: str | None = Field(None, strict=True, min_length=1)
    args: list[str] = Field(default_factory=list, strict=True)
    workdir: str | None = Field(None, strict=True, min_length=1)  # relative: the spec's folder
    env: dict[str, str] = Field(default_factory=dict, strict=True)
    # The ranks' interpreter, or a venv folder (its bin/python); relative: the spec's folder.
    python: str | None = Field(None, strict=True, min_length=1)

    @field_validator("env", mode="before")
    @classmethod
    def _variables(cls, value: object) -> object:
        """Require NAME: "text" pairs that leave torchrun's and Relay's variables alone."""
        if not isinstance(value, dict):
            return value  # pydantic says what a mapping is
        for name, text in value.items():
            if not isinstance(name, str) or not re.fullmatch(ENV_NAME_PATTERN, name):
                raise FieldValueError(
                    "environment variable names of letters, digits and '_' (not starting "
                    "with a digit)", name, "rename it, e.g. env: {HF_HOME: /data/hf}")
            reserved = next((r for r in RESERVED_ENV if name == r or
                             (r.endswith("_") and name.startswith(r))), None)
            if reserved is not None:
                raise FieldValueError(
                    "variables other than torchrun's and Relay's", name,
                    f"remove {name} from entrypoint.env: Relay sets it for every rank "
                    f"({', '.join(RESERVED_ENV)}*)")
            if not isinstance(text, str):
                raise FieldValueError(
                    f"a text value for {name}", text,
                    f"quote it, e.g. env: {{{name}: \"{text}\"}}")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> EntrypointSpec:
        """Require a module or a script, not both."""
        if (self.module is None) == (self.script is None):
            found = "both" if self.module else "neither"
            raise FieldValueError(
                "exactly one of entrypoint.module or entrypoint.script", found,
                "write e.g. entrypoint: {module: mypkg.train, args: [--lr, '3e-4']} or "
                "entrypoint: {script: train.py}")
        return self

    def resolved(self, spec_file: Path) -> Entrypoint:
        """Return it for the launch file, a relative script taken from the spec's folder."""
        script = None if self.script is None else _from_spec(self.script, spec_file)
        workdir = None if self.workdir is None else _from_spec(self.workdir, spec_file)
        python = None if self.python is None else interpreter_of(_from_spec(self.python,
                                                                            spec_file))
        return Entrypoint(module=self.module, script=script, args=list(self.args),
                          workdir=workdir, env=dict(self.env), python=python)


def _from_spec(name: str, spec_file: Path) -> str:
    """Return a path of a spec, absolute, a relative one taken from the spec's folder.

    Absolute because the ranks and the import preflight run in another working
    directory: ``relay spec check training/examples/x.yaml`` must not hand them
    ``training/examples/x.py``.
    """
    path = Path(name).expanduser()
    return str(path if path.is_absolute() else Path(spec_file).resolve().parent / path)


class Toleration(BaseModel):
    """One taint the attempt's pods tolerate (a Kubernetes ``core/v1`` Toleration)."""

    model_config = FROZEN

    key: str | None = Field(None, strict=True, pattern=LABEL_KEY_PATTERN)
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = Field(None, strict=True)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, strict=True, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        """Refuse what the API server would: a value with Exists, a key-less Equal, seconds
        without NoExecute."""
        shown = ", ".join(f"{k}: {v}" for k, v in (("key", self.key), ("operator",
                          self.operator), ("value", self.value)) if v is not None)
        if self.operator == "Exists" and self.value:
            raise FieldValueError("no value with operator Exists", None,
                                  "drop value, or write operator: Equal", shown=shown)
        if self.operator == "Equal" and not self.key:
            raise FieldValueError("a key with operator Equal", None,
                                  "name the taint's key, or write operator: Exists to "
                                  "tolerate every taint", shown=shown)
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise FieldValueError("toleration_seconds only with effect NoExecute", None,
                                  "write effect: NoExecute, or drop toleration_seconds",
                                  shown=f"effect: {self.effect}")
        return self

    def manifest(self) -> dict[str, Any]:
        """Return the toleration as the pod spec writes it."""
        raw = {"key": self.key, "operator": self.operator, "value": self.value,
               "effect": self.effect, "tolerationSeconds": self.toleration_seconds}
        return {k: v for k, v in raw.items() if v is not None}


# A pod's grace below this leaves a preemption notice under 4 s to drain: a node agent stops
# its ranks itself 6 s before the grace ends (relay_train.agent.notice.STOP_MARGIN_SECONDS).
MIN_TERMINATION_GRACE_SECONDS = 10.0


class KubernetesSpec(BaseModel):
    """Where and how segment attempts run when ``launcher: kubernetes``."""

    model_config = FROZEN

    image: str = Field(strict=True, min_length=1)
    namespace: str = Field("default", strict=True, pattern=DNS_LABEL_PATTERN)
    service_account: str = Field("relay-worker", strict=True, pattern=DNS_LABEL_PATTERN)
    gpus_per_pod: int = Field(0, strict=True, ge=0)
    active_deadline: float = Field(6 * 3600.0, gt=0)
    # The pods' terminationGracePeriodSeconds, a preemption notice's grace: the agent's ranks
    # train (and Relay drains them) for all of it but the last 6 s, which stop them.
    termination_grace: float = Field(30.0)
    taint_quarantine: bool = Field(False, strict=True)
    # Each pod's CPU and memory, requested and limited alike (so the pods are Guaranteed
    # and a rank that grows past it is OOM-killed, a crash the policy sees).
    cpu: str = Field("2", strict=True, pattern=QUANTITY_PATTERN)
    memory: str = Field("8Gi", strict=True, pattern=QUANTITY_PATTERN)
    # Where Airflow's workers and triggerer run: the only pods that may reach the agents.
    airflow_namespace: str = Field("airflow", strict=True, pattern=DNS_LABEL_PATTERN)
    # The channel to the pods' agents crosses hosts: TLS. The agents' certificate and key
    # (a kubernetes.io/tls Secret mounted into every pod) and the CA Relay verifies them by (a
    # Secret with ca.crt, read by the launcher). Both null: clear text (see docs/security.md).
    channel_tls_secret: str | None = Field("relay-channel-tls", strict=True,
                                           pattern=DNS_LABEL_PATTERN)
    channel_ca_secret: str | None = Field("relay-channel-ca", strict=True,
                                          pattern=DNS_LABEL_PATTERN)
    # Where the pods may go: the nodes' labels they require, the taints they tolerate.
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)

    @field_validator("active_deadline", "termination_grace", mode="before")
    @classmethod
    def _duration(cls, value: object) -> float:
        """Parse "30m", "6h" or a number of seconds."""
        return parse_duration(value)

    @field_validator("termination_grace")
    @classmethod
    def _grace(cls, value: float) -> float:
        """Require a grace that leaves a preemption notice some seconds to drain."""
        if not value >= MIN_TERMINATION_GRACE_SECONDS:
            raise FieldValueError(
                f"at least {MIN_TERMINATION_GRACE_SECONDS:g} seconds (a node agent keeps the "
                "last 6 s of a notice's grace to stop its ranks; the rest is the drain window)",
                value, "write e.g. termination_grace: 30s (Kubernetes' default)")
        return value

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _quantity(cls, value: object) -> object:
        """Take a plain number (cpu: 8) as the quantity it writes."""
        if isinstance(value, int | float) and not isinstance(value, bool):
            return format(value, "g")
        return value
    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        """Require label keys and values the API server accepts."""
        for label, wanted in value.items():
            if not re.match(LABEL_KEY_PATTERN, label) or not re.match(LABEL_VALUE_PATTERN,
                                                                       wanted):
                raise FieldValueError(
                    "node labels as key: value (a key like kubernetes.io/arch or pool, a "
                    "value of up to 63 letters, digits, '-', '_' or '.')", f"{label}: {wanted}",
                    "write the label exactly as `kubectl get nodes --show-labels` shows it")
        return value

    @model_validator(mode="after")
    def _tls_both_or_neither(self) -> KubernetesSpec:
        """Require the agents' TLS Secret and the CA Secret together (or neither: clear text)."""
        if (self.channel_tls_secret is None) != (self.channel_ca_secret is None):
            raise FieldValueError(
                "kubernetes.channel_tls_secret and kubernetes.channel_ca_secret both set (TLS) "
                "or both null (clear text)",
                None,
                "name both Secrets (see docs/security.md#tls-between-hosts), or write "
                "channel_tls_secret: null and channel_ca_secret: null for clear text",
                shown=f"channel_tls_secret: {self.channel_tls_secret or 'null'}, "
                f"channel_ca_secret: {self.channel_ca_secret or 'null'}")
        return self
