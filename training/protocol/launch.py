"""The launch file: everything a node agent and its ranks need, as one JSON document.

Written by a Relay launcher into the attempt folder; read by ``relay_train.agent.node``
and ``relay_train.worker``. Stdlib only, like the heartbeat module.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relay_train.protocol.env import (
    ENV_ATTEMPT,
    ENV_ATTEMPT_DIR,
    ENV_END_STEP,
    ENV_LAUNCH,
    ENV_RESUME_PATH,
    ENV_SEGMENT,
    ENV_START_STEP,
    ENV_TOTAL_STEPS,
    ENV_TRACKING_URI,
)

LAUNCH_FILE = "launch.json"
DRAIN_FILE = "drain.json"  # written by Relay: {"stop_at": STEP}; see relay_train.worker
FIRST_STEP_FILE = "first_step.json"  # rank 0, first step: step, at, node, spawned_at, startup
RESULT_FILE = "result.json"  # written by rank 0 when the attempt ends: steps and loop time
# Written by Relay before it signals the processes of an attempt whose folder the agents
# share (the local launcher): a SIGTERM after it is Relay's stop, not a preemption notice
# (relay_train.agent.notice), even when the channel's stop request came late or not at all.
STOP_FILE = "stop.json"
ADOPT_FILE = "adopt.json"  # written by Relay: a later segment's task adopted this workload
BOUNDARIES_FILE = "boundaries.jsonl"  # rank 0: what each segment boundary cost the loop
BUILTIN_ENTRYPOINT = "relay_train.examples.charlm"  # what a spec without an entrypoint runs

# A rank whose script returned (exit 0) before its segment's end: relay_train.worker exits
# with this code (sysexits' EX_CONFIG) after writing short_segment_message() as the last line
# of its log; Relay's watcher needs both (a script's own sys.exit(78) is a crash).
SHORT_SEGMENT_EXIT = 78
# A node agent that received a preemption notice (SIGTERM while its ranks ran, not Relay's
# stop) exits with this code (sysexits' EX_TEMPFAIL): the node was taken back, not broken.
PREEMPTED_EXIT = 75
_SHORT_SEGMENT = re.compile(r"relay_train: short segment: rank (\d+) .* at step (\d+); "
                            r"expected .* to step (\d+)")


def short_segment_message(rank: int, reached: int, expected: int, segment: int) -> str:
    """Return the line a rank that ended early writes last (:func:`parse_short_segment`)."""
    return (f"relay_train: short segment: rank {rank} returned from the script at step "
            f"{reached}; expected it to train to step {expected} (the end of segment "
            f"{segment}). Relay does not retry this: fix the script's loop, e.g. `for step in "
            "session.steps():` (it runs to session.end_step), and do not return or exit "
            "before it ends")


def parse_short_segment(log_tail: str) -> tuple[int, int, int] | None:
    """Return (rank, step reached, step expected) from a rank's log tail, or None."""
    found = _SHORT_SEGMENT.findall(log_tail)
    if not found:
        return None
    rank, reached, expected = found[-1]
    return int(rank), int(reached), int(expected)


def attempt_id_of(attempt_dir: Path) -> str:
    """Return the id of the attempt in ``attempt_dir``: ``<dag_id>/<run>/segment-NNN/try-N``."""
    return "/".join(Path(attempt_dir).parts[-4:])


@dataclass(frozen=True)
class Entrypoint:
    """The script a rank runs: a module (``python -m``) or a file, with its arguments."""

    module: str | None = None
    script: str | None = None
    args: list[str] = field(default_factory=list)
    workdir: str | None = None  # the rank's working directory (default: the attempt folder)
    env: dict[str, str] = field(default_factory=dict)  # set in the rank before it runs
    # The rank's own interpreter (a venv's bin/python): the rank is started with it instead
    # of forked from the agent (relay_train.protocol.interpreter); None: the agent's.
    python: str | None = None

    def describe(self) -> str:
        """Return it as a command line would show it."""
        head = f"-m {self.module}" if self.module else str(self.script)
        return " ".join([head, *self.args])


@dataclass(frozen=True)
class ResumeFrom:
    """The verified checkpoint a segment attempt starts from.

    ``format`` ``torch``: ``path`` is one file with ``sha256``; ``dcp``: ``path`` is a
    ``torch.distributed.checkpoint`` folder whose files ``files`` lists (relative path:
    sha256), and ``sha256`` is the digest of that table (see ``relay_train.protocol.manifest``).
    """

    path: str
    sha256: str
    run_id: str
    step: int
    format: str = "torch"
    files: dict[str, str] = field(default_factory=dict, hash=False)
    artifact: str = ""  # the checkpoint's URI in MLflow's artifact store; ranks fetch it there
    # The signed manifest (its JSON): every rank checks its signature, and that the fields
    # above are its own, before fetching or loading anything (relay_train.protocol.signing).
    manifest: str = ""


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
    tracking_uri: str
    run_id: str
    attempt_dir: str
    attempt: int
    segment: int
    # Where the ranks meet (rank 0's store): chosen by the launcher when it launches.
    master_addr: str = ""
    master_port: int = 0
    heartbeat_interval_seconds: float = 0.5
    collective_timeout_seconds: float = 1800.0
    backend: str = "auto"  # auto | gloo | nccl (NCCL when every local rank has a GPU)
    deterministic: bool = True
    resume: ResumeFrom | None = None
    chaos: list[dict[str, Any]] = field(default_factory=list)
    entrypoint: Entrypoint = field(default_factory=lambda: Entrypoint(BUILTIN_ENTRYPOINT))
    attempt_id: str = ""  # what every channel message names (fencing); see attempt_id_of
    agent_ports: dict[str, int] = field(default_factory=dict)  # node -> its agent's port (local)
    # Segment boundaries without a restart (relay_train.boundary): every segment end of the
    # job (a checkpoint is always published there); the step the ranks may train on to past
    # ``end_step`` before a later segment's task adopts them (None: stop at ``end_step``);
    # how long they wait there for that adoption before finishing.
    boundaries: list[int] = field(default_factory=list)
    run_on_to: int | None = None
    adopt_wait_seconds: float = 120.0
    # The attempt's channel secret (relay_train.protocol.channel_auth): made fresh by the
    # launcher for each attempt; its agents sign and check every channel message with it.
    # Never logged, never in a launch record that travels (relay.launchers.launch_record).
    channel_secret: str = field(default="", repr=False)
    # The deployment's checkpoint key ring ({"write": id, "keys": {id: secret}}), for the
    # ranks to sign and verify manifests. Only in this 0600 file on the launching machine:
    # left out of launch records and of a Kubernetes ConfigMap (pods mount a Secret, named
    # by RELAY_CHECKPOINT_KEYS_FILE instead).
    checkpoint_keys: dict[str, Any] = field(default_factory=dict, repr=False)
    # The job's total_steps (its last step), for the script (Session.total_steps); 0 in
    # launch files from before it was written: the last segment end known, else end_step.
    total_steps: int = 0
    # The spec's steps_per_epoch (0: not given): session.batches(loader) checks len(loader).
    steps_per_epoch: int = 0
    # Each node agent logs its ranks' logs to the MLflow run when they end (set by
    # launchers whose nodes do not share Relay's disk: relay_train.agent.ranks.ship_logs).
    logs_to_mlflow: bool = False

    @property
    def job_steps(self) -> int:
        """Return the job's last step: ``total_steps``, else the last segment end known."""
        return self.total_steps or max([self.end_step, *self.boundaries])

    @property
    def fence_id(self) -> str:
        """Return the attempt's id on the channel (set by the launcher; else from its folder)."""
        return self.attempt_id or attempt_id_of(self.root)

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
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> LaunchConfig:
        """Rebuild a launch config from ``dataclasses.asdict`` of one."""
        raw = dict(fields)
        if not raw.get("tracking_uri"):  # left out of the file: the environment's (a Secret)
            raw["tracking_uri"] = os.environ.get(ENV_TRACKING_URI, "")
        resume = raw.pop("resume", None)
        entry = raw.pop("entrypoint", None)
        return cls(**raw, resume=ResumeFrom(**resume) if resume else None,
                   entrypoint=Entrypoint(**entry) if entry else Entrypoint(BUILTIN_ENTRYPOINT))

    def rank_environment(self, node: str, local_rank: int) -> dict[str, str]:
        """Return what torchrun would set for this rank, plus Relay's own variables."""
        node_rank = self.nodes.index(node)
        rank = self.global_rank(node, local_rank)
        world = str(self.world_size)
        return {
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": world,
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node), "GROUP_RANK": str(node_rank),
            "GROUP_WORLD_SIZE": str(len(self.nodes)), "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": world, "ROLE_NAME": "default", "NODE_RANK": str(node_rank),
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RUN_ID": f"{self.job}-{self.segment}-{self.attempt}",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "OMP_NUM_THREADS": "1",
            ENV_LAUNCH: str(self.root / LAUNCH_FILE),
            ENV_START_STEP: str(self.start_step), ENV_END_STEP: str(self.end_step),
            ENV_TOTAL_STEPS: str(self.job_steps),
            ENV_ATTEMPT_DIR: str(self.root), ENV_SEGMENT: str(self.segment),
            ENV_ATTEMPT: str(self.attempt),
            ENV_RESUME_PATH: self.resume.path if self.resume else "",
        }
