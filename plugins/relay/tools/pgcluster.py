"""A private PostgreSQL cluster for Airflow's metadata (Debian's postgresql package).

`make up` with ``RELAY_METADATA_DB=postgres`` starts one under
``$RELAY_HOME/services/postgres`` on a loopback port (``initdb -A trust``, then
``pg_ctl start``), creates the ``airflow`` database and hands Airflow its URL.
PostgreSQL refuses to run as root, so as root the cluster runs as the
``postgres`` system user.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from relay.core.exceptions import ServiceError
from relay_train.protocol import pids

PG_USER = "postgres"
DATABASE = "airflow"


def _bin(name: str) -> str:
    found = shutil.which(name) or next(
        (str(p) for p in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))), None)
    if found is None:
        raise ServiceError(f"PostgreSQL's {name} not found: apt-get install -y postgresql, "
                           "or leave RELAY_METADATA_DB unset for SQLite")
    return found


def _as_owner(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", PG_USER, "--", *cmd] if os.geteuid() == 0 else cmd


def _run(cmd: list[str], log: Path) -> None:
    with log.open("ab") as out:
        done = subprocess.run(_as_owner(cmd), stdout=out, stderr=subprocess.STDOUT, check=False,
                              stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise ServiceError(f"{' '.join(cmd[:2])} failed (exit {done.returncode}); see {log}")


def start(root: Path, port: int, log: Path) -> int:
    """Start (creating it once) the cluster in ``root`` on ``port``; return the postmaster PID."""
    data = root / "data"
    root.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(root, PG_USER, PG_USER)
    fresh = not (data / "PG_VERSION").exists()
    if fresh:
        _run([_bin("initdb"), "-D", str(data), "-A", "trust", "-U", PG_USER, "-E", "UTF8"], log)
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
    _run([_bin("pg_ctl"), "-D", str(data), "-o", opts, "-l", str(root / "server.log"), "-w",
          "start"], log)
    if fresh:
        _run([_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", PG_USER, DATABASE],
             log)
    return postmaster_pid(data)


def postmaster_pid(data: Path) -> int:
    """Return the running postmaster's PID from its pid file."""
    return int((data / "postmaster.pid").read_text().splitlines()[0])


def url(port: int) -> str:
    """Return Airflow's SQLAlchemy URL of the cluster's ``airflow`` database."""
    return f"postgresql+psycopg2://{PG_USER}@127.0.0.1:{port}/{DATABASE}"


def stop(pid: int, started: int | None, grace: float = 20.0) -> bool:
    """Stop the postmaster by PID: SIGINT is PostgreSQL's fast shutdown; SIGKILL if it hangs.

    Only while ``pid`` is still the process that started at ``started`` (see
    :mod:`relay_train.protocol.pids`); return whether it was signalled.
    """
    if not pids.is_running(pid, started) or not pids.signal_process(pid, started, signal.SIGINT):
        return False
    deadline = time.monotonic() + grace
    while pids.is_running(pid, started) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pids.is_running(pid, started):
        pids.signal_process(pid, started, signal.SIGKILL)
    return True
