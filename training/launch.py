"""The launch file: everything a node agent and its ranks need, as one JSON document.

Written by a Relay launcher into the attempt folder; read by ``training.agent``
and ``training.worker``. Stdlib only, like the heartbeat module.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LAUNCH_FILE = "launch.json"
DRAIN_FILE = "drain.json"  # written by Relay: {"stop_at": STEP}; see training.worker
FIRST_STEP_FILE = "first_step.json"  # written by rank 0 after its first step: {"step", "at"}


@dataclass(frozen=True)
class ResumeFrom:
    """The verified checkpoint a segment attempt starts from."""

    path: str
    sha256: str
    run_id: str
    step: int


@dataclass(frozen=True)
class LaunchConfig:
    """One segment attempt, as the workers see it."""

    job: str
    seed: int
    model: dict[str, Any]
    data: dict[str, Any]
    optimizer: dict[str, Any]
    start_step: int
    end_step: int
    checkpoint_every: int
    nodes: list[str]
    ranks_per_node: int
    master_addr: str
    master_port: int
    tracking_uri: str
    run_id: str
    attempt_dir: str
    attempt: int
    segment: int
    heartbeat_interval_seconds: float = 0.5
    collective_timeout_seconds: float = 1800.0
    resume: ResumeFrom | None = None
    chaos: list[dict[str, Any]] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        """Return the number of ranks across all nodes."""
        return len(self.nodes) * self.ranks_per_node

    @property
    def root(self) -> Path:
        """Return the attempt folder."""
        return Path(self.attempt_dir)

    @property
    def heartbeat_dir(self) -> Path:
        """Return where ranks write heartbeats."""
        return self.root / "heartbeats"

    @property
    def status_dir(self) -> Path:
        """Return where node agents write their status."""
        return self.root / "status"

    @property
    def log_dir(self) -> Path:
        """Return where rank and agent logs go."""
        return self.root / "logs"

    def global_rank(self, node: str, local_rank: int) -> int:
        """Return the global rank of ``local_rank`` on ``node``."""
        return self.nodes.index(node) * self.ranks_per_node + local_rank

    def write(self, path: Path) -> None:
        """Write the launch file, readable by its owner only (it holds the tracking URI,
        which may carry credentials)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing file keeps its mode otherwise
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(json.dumps(asdict(self), indent=2, sort_keys=True))

    @classmethod
    def read(cls, path: Path) -> LaunchConfig:
        """Read a launch file written by :meth:`write`."""
        raw = json.loads(path.read_text())
        resume = raw.pop("resume", None)
        return cls(**raw, resume=ResumeFrom(**resume) if resume else None)
