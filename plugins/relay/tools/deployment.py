"""What `relay services up` started, as recorded in ``services.json``, and what of it is still ours.

Each component's PID is recorded with its start time (clock ticks since boot,
:mod:`relay_train.protocol.pids`) and the boot it counts from, so that `down` and
`restart` never signal a PID that another process got after a crash or a reboot.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay.core import settings
from relay.core.proctree import descendants, group_members
from relay_train.protocol.pids import boot_id, is_running, is_same_process, start_time

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ports:
    """The loopback ports one deployment uses (free ones unless set)."""

    api: int
    mlflow: int
    worker_logs: int
    trigger_logs: int
    postgres: int = 0  # 0: Airflow's metadata stays in SQLite


@dataclass(frozen=True)
class Deployment:
    """What `up` started: where, on which ports, which process groups.

    ``started`` holds each component's start time (clock ticks since boot, see
    :mod:`relay_train.protocol.pids`) and ``boot`` the boot they count from: a
    recorded PID is signalled only while both still match.
    """

    home: str
    ports: Ports
    pids: dict[str, int]
    started_at: float
    postgres_pid: int = 0
    postgres_dir: str = ""
    started: dict[str, int | None] = field(default_factory=dict)
    postgres_started: int | None = None
    boot: str | None = None

    def same_boot(self) -> bool:
        """Return whether the machine has not restarted since the record (unknown: True)."""
        return self.boot is None or self.boot == boot_id()

    def running(self, name: str) -> bool:
        """Return whether component ``name`` still runs as the process `up` started."""
        return self.same_boot() and is_running(self.pids[name], self.started.get(name))

    def postgres_running(self) -> bool:
        """Return whether the recorded PostgreSQL postmaster still runs."""
        return (bool(self.postgres_pid) and self.same_boot()
                and is_running(self.postgres_pid, self.postgres_started))

    @property
    def api_url(self) -> str:
        """Return the Airflow API server's base URL."""
        return f"http://127.0.0.1:{self.ports.api}"

    @property
    def mlflow_url(self) -> str:
        """Return the MLflow server's URL."""
        return f"http://127.0.0.1:{self.ports.mlflow}"


def services_dir(home: Path | None = None) -> Path:
    """Return where `up` keeps the deployment's state, logs and stores."""
    return (home or settings.relay_home()) / "services"


def state_file(home: Path | None = None) -> Path:
    """Return the file recording the running deployment's PIDs and ports."""
    return services_dir(home) / "services.json"


def read_deployment(home: Path | None = None) -> Deployment | None:
    """Return the recorded deployment, if `up` left one."""
    path = state_file(home)
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    return Deployment(raw["home"], Ports(**raw["ports"]), raw["pids"], raw["started_at"],
                      raw.get("postgres_pid", 0), raw.get("postgres_dir", ""),
                      raw.get("started", {}), raw.get("postgres_started"), raw.get("boot"))


def record(deployment: Deployment) -> None:
    """Write ``deployment`` to its ``services.json``."""
    state_file(Path(deployment.home)).write_text(json.dumps(asdict(deployment), indent=2))


def stoppable(deployment: Deployment, name: str) -> tuple[list[int], list[int]]:
    """Return the PIDs and process groups of component ``name`` that are still Relay's.

    A live recorded PID counts only if its start time matches the record (and the machine
    has not restarted); then its group and descendants are ours. A leader that exited may
    leave its group behind (a SIGKILLed scheduler's workers): Linux hands out no PID still
    in use as a group id, so those members are ours. A PID that now names another process
    is left alone, with its group and children.
    """
    pid, started = deployment.pids[name], deployment.started.get(name)
    if not deployment.same_boot():
        log.warning("Not stopping %s (pid %d): %s was written before the machine restarted, "
                    "so the PID is another process's now", name, pid,
                    state_file(Path(deployment.home)))
        return [], []
    if is_same_process(pid, started):
        members = group_members(pid)
        return sorted({*members, *descendants(pid)}), [pid] if members else []
    if start_time(pid) is None:  # exited
        members = group_members(pid)
        return members, [pid] if members else []
    if started is None:
        log.warning("Not stopping %s: %s has no start time for pid %d (written by an older "
                    "Relay), so it may be another process's now; stop %s by hand if it is "
                    "Relay's", name, state_file(Path(deployment.home)), pid, name)
    else:
        log.warning("Not stopping %s: pid %d now belongs to another process (started at tick "
                    "%s, recorded %d); stop what is left of %s by hand if it still runs", name,
                    pid, start_time(pid), started, name)
    return [], []
