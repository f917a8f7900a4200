"""Where a segment runs: local processes, Kubernetes or Slurm, behind one :class:`Launcher` seam.

Everything outside this package gets its launcher from :func:`launcher_from`
(or :func:`launcher_for` a job spec) and uses only the protocol in
:mod:`relay.launchers.base`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from relay.launchers.base import Continuity, Launcher, LaunchStatus, NodeStatus

if TYPE_CHECKING:
    from relay.spec.job import JobSpec

__all__ = ["Continuity", "Launcher", "LaunchStatus", "NodeStatus", "launcher_for",
           "launcher_from"]

ENV_KUBERNETES_CONN_ID = "RELAY_KUBERNETES_CONN_ID"  # Airflow connection of the cluster


def launcher_from(config: Mapping[str, Any] | None = None) -> Launcher:
    """Build the launcher a ``config()`` describes (None or ``{"kind": "local"}``: local)."""
    settings = dict(config or {"kind": "local"})
    kind = settings.pop("kind", "local")
    if kind == "local":
        from relay.launchers.local.launcher import LocalLauncher

        return LocalLauncher()
    if kind == "kubernetes":
        from relay.launchers.k8s.launcher import KubernetesLauncher
        from relay.spec.sections import KubernetesSpec

        conn_id = settings.pop("conn_id", None) or os.environ.get(ENV_KUBERNETES_CONN_ID)
        return KubernetesLauncher(KubernetesSpec.model_validate(settings), conn_id=conn_id)
    if kind == "slurm":
        from relay.launchers.slurm.launcher import SlurmLauncher
        from relay.spec.slurm import SlurmSpec

        return SlurmLauncher(SlurmSpec.model_validate(settings))
    raise ValueError(f"launcher kind: expected 'local', 'kubernetes' or 'slurm', found {kind!r}")


def launcher_for(spec: JobSpec) -> Launcher:
    """Return the launcher a job spec asks for (``launcher:`` and its ``kubernetes:`` or
    ``slurm:`` section)."""
    from relay.spec.slurm import SlurmSpec

    if spec.launcher == "kubernetes" and spec.kubernetes is not None:
        return launcher_from({"kind": "kubernetes", **spec.kubernetes.model_dump()})
    if spec.launcher == "slurm":
        return launcher_from({"kind": "slurm", **(spec.slurm or SlurmSpec()).model_dump()})
    return launcher_from(None)
