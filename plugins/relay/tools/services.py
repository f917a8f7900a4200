"""`make up` / `make down`: a real Airflow (separate processes) and an MLflow server on loopback.

`up` starts the API server (with the UI), scheduler, DAG processor and
triggerer as separate processes with the LocalExecutor, plus ``mlflow server``
with its own backend store and artifact root, each in its own session; it
records their PIDs in ``services.json`` and waits until every one is healthy.
`down` stops exactly the recorded process groups and their descendants (never
by name, and only while each recorded PID is still the process started then, see
:mod:`relay.tools.deployment`) and waits until their ports are free; then the
training processes of DAG runs it interrupted (agents, ranks and standby agents
run in sessions of their own, recorded by PID in their attempt folders, so
stopping Airflow leaves them training, unwatched).

Three traps of a hand-started Airflow are avoided here: every component runs
with this virtualenv's ``bin/`` first on ``PATH`` (standalone-style launches
spawn ``airflow`` from ``PATH``), Relay's DAGs are unpaused (they are paused at
creation), and the log servers get free ports of their own (a SIGKILLed
scheduler's old log server keeps port 8793).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from relay.core import settings
from relay.core.airflow_api import NOTES_CONNECTION, AirflowApi
from relay.core.attempt import Attempt
from relay.core.exceptions import ServiceError
from relay.core.proctree import stop_pids
from relay.launchers.local.launcher import HANDLE_FILE, LocalLauncher, free_port
from relay.launchers.local.prestart import residents_dir
from relay.launchers.local.warm_agents import release, release_run
from relay.lineage.links import experiments_url
from relay.tools import pgcluster
from relay.tools.airflow_env import airflow_bin, airflow_env, ensure_airflow_db
from relay.tools.deployment import (
    Deployment,
    Ports,
    read_deployment,
    record,
    services_dir,
    state_file,
    stoppable,
)
from relay_train.protocol.pids import boot_id, start_time

log = logging.getLogger(__name__)

ADMIN_USER = "admin"
NOTES_USER = "relay"  # role "user": may edit DAG runs and task instances, their notes
AIRFLOW_COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")


def postgres_dir(home: Path) -> Path:
    """Return where the metadata cluster lives: in the services folder when the ``postgres``
    user can reach it, else a folder of its own under /tmp (a private home is often 0700)."""
    inside = services_dir(home) / "postgres"
    if os.geteuid() != 0:
        return inside
    probe = subprocess.run(["runuser", "-u", pgcluster.PG_USER, "--", "test", "-x",
                            str(services_dir(home))], check=False)
    if probe.returncode == 0:
        return inside
    digest = hashlib.sha256(str(home).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"relay-postgres-{digest}"


def port_open(port: int) -> bool:
    """Return whether something listens on a loopback port."""
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def choose_ports() -> Ports:
    """Return the ports from ``RELAY_*_PORT`` variables, or free ones."""
    def pick(var: str) -> int:
        value = os.environ.get(var)
        return int(value) if value else free_port()

    db = os.environ.get("RELAY_METADATA_DB", "sqlite")
    if db not in ("sqlite", "postgres"):
        raise ServiceError(f"RELAY_METADATA_DB: expected sqlite or postgres, found {db!r}. "
                           "Unset it for SQLite or set it to postgres.")
    return Ports(api=pick("RELAY_API_PORT"), mlflow=pick("RELAY_MLFLOW_PORT"),
                 worker_logs=pick("RELAY_WORKER_LOG_PORT"),
                 trigger_logs=pick("RELAY_TRIGGER_LOG_PORT"),
                 postgres=pick("RELAY_POSTGRES_PORT") if db == "postgres" else 0)


def _secret(path: Path) -> str:
    if not path.exists():
        path.write_text(secrets.token_urlsafe(64))
        path.chmod(0o600)
    return path.read_text().strip()


def _notes_password(path: Path) -> str:
    """Return the notes user's password, added to the simple auth manager's passwords file
    before the API server starts (it keeps the passwords it finds, makes the others)."""
    found = json.loads(path.read_text()) if path.exists() and path.read_text().strip() else {}
    if NOTES_USER not in found:
        found[NOTES_USER] = secrets.token_urlsafe(16)
        path.write_text(json.dumps(found) + "\n")
        path.chmod(0o600)
    return str(found[NOTES_USER])


def services_env(home: Path, ports: Ports) -> dict[str, str]:
    """Return the environment every component (and so every task) runs with."""
    sdir = services_dir(home)
    env = airflow_env(home)
    bin_dir = str(Path(sys.executable).parent)
    base = f"http://127.0.0.1:{ports.api}"
    env.update({
        "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
        # This checkout's code, in every component and task (not another editable install).
        "PYTHONPATH": os.pathsep.join(
            [str(settings.REPO_ROOT / "plugins"), str(settings.REPO_ROOT)]
            + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        "AIRFLOW__API__PORT": str(ports.api),
        "AIRFLOW__API__BASE_URL": base,
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{base}/execution/",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(ports.worker_logs),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(ports.trigger_logs),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin,{NOTES_USER}:user",
        # The segment tasks write Relay's notes through the REST API as this user.
        f"AIRFLOW_CONN_{NOTES_CONNECTION.upper()}": json.dumps({
            "conn_type": "http", "host": "127.0.0.1", "port": ports.api, "login": NOTES_USER,
            "password": _notes_password(sdir / "passwords.json")}),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(sdir / "passwords.json"),
        # One secret for every component: the scheduler signs task tokens the API checks.
        "AIRFLOW__API_AUTH__JWT_SECRET": _secret(sdir / "jwt_secret"),
        "AIRFLOW__API__SECRET_KEY": _secret(sdir / "api_secret"),
        "AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL": "5",
        "RELAY_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{ports.mlflow}",
        "RELAY_SERVICES_API_URL": base,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    })
    if ports.postgres:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = pgcluster.url(ports.postgres)
    return env


def _mlflow_command(home: Path, ports: Ports) -> list[str]:
    store = services_dir(home) / "mlflow"
    store.mkdir(parents=True, exist_ok=True)
    return [str(Path(sys.executable).with_name("mlflow")), "server",
            "--host", "127.0.0.1", "--port", str(ports.mlflow), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
            "--artifacts-destination", str(store / "artifacts"), "--serve-artifacts"]


def _spawn(name: str, cmd: list[str], env: dict[str, str], logs: Path) -> int:
    out = (logs / f"{name}.log").open("ab")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    out.close()
    return proc.pid


def _start(home: Path, ports: Ports, name: str, env: dict[str, str]) -> int:
    if name == "mlflow":
        cmd = _mlflow_command(home, ports)
    else:
        extra = ["--host", "127.0.0.1", "--port", str(ports.api)] if name == "api-server" else []
        cmd = [airflow_bin(), name, *extra]
    return _spawn(name, cmd, env, services_dir(home) / "logs")


def restart(name: str, home: Path | None = None, grace: float = 10.0) -> int:
    """Stop what is left of one component (its whole process group) and start it again.

    After a crash (e.g. a SIGKILLed scheduler) its children live on: the log
    server holding its port, LocalExecutor workers. They are stopped first, so
    the new process can bind the same ports. Returns the new PID.
    """
    home = (home or settings.relay_home()).resolve()
    deployment = read_deployment(home)
    if deployment is None or name not in deployment.pids:
        raise ServiceError(f"no running {name} recorded in {state_file(home)}")
    if not deployment.same_boot():
        raise ServiceError(f"{state_file(home)} was written before the machine restarted: its "
                           "PIDs are other processes' now. Run `relay services down` (it signals "
                           "none of them), then `relay services up`")
    old = deployment.pids[name]
    leftovers, groups = stoppable(deployment, name)
    stop_pids(leftovers, groups=groups, grace=grace, started={old: deployment.started.get(name)})
    pid = _start(home, deployment.ports, name, services_env(home, deployment.ports))
    record(replace(deployment, pids={**deployment.pids, name: pid},
                    started={**deployment.started, name: start_time(pid)}))
    log.info("Restarted %s: pid %d (was %d)", name, pid, old)
    return pid


def up(home: Path | None = None, timeout: float = 240.0) -> Deployment:
    """Start Airflow and MLflow, wait until healthy, unpause Relay's DAGs."""
    home = (home or settings.relay_home()).resolve()
    old = read_deployment(home)
    if old is not None and (any(old.running(n) for n in old.pids) or old.postgres_running()):
        raise ServiceError(f"services already running (see {state_file(home)}); "
                           "run `make down` first")
    sdir = services_dir(home)
    logs = sdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ports = choose_ports()
    env = services_env(home, ports)
    deployment = Deployment(str(home), ports, {}, time.time(), boot=boot_id())
    try:  # record every process as soon as it exists, so a failure stops what did start
        _start_recorded(deployment, "mlflow", env)
        if ports.postgres:
            pg_dir = postgres_dir(home)
            pg_pid = pgcluster.start(pg_dir, ports.postgres, logs / "postgres.log")
            deployment = replace(deployment, postgres_dir=str(pg_dir), postgres_pid=pg_pid,
                                 postgres_started=start_time(pg_pid))
            record(deployment)
        ensure_airflow_db(env, logs / "airflow-db.log")
        for name in AIRFLOW_COMPONENTS:
            _start_recorded(deployment, name, env)
        wait_healthy(deployment, timeout)
    except BaseException:
        down(home)
        raise
    return deployment


def _start_recorded(deployment: Deployment, name: str, env: dict[str, str]) -> None:
    """Start component ``name`` and record its PID and start time at once."""
    pid = _start(Path(deployment.home), deployment.ports, name, env)
    deployment.pids[name] = pid
    deployment.started[name] = start_time(pid)  # our unreaped child: readable even if it died
    record(deployment)


def wait_healthy(deployment: Deployment, timeout: float) -> None:
    """Wait until MLflow and every Airflow component are healthy and Relay's DAGs unpaused."""
    deadline = time.monotonic() + timeout
    problem = "not started"
    while time.monotonic() < deadline:
        # The API server writes the generated password when it starts.
        api = AirflowApi(deployment.api_url, ADMIN_USER, admin_password(Path(deployment.home)))
        dead = [n for n in deployment.pids if not deployment.running(n)]
        if dead:
            raise ServiceError(f"{', '.join(dead)} exited during start-up; see "
                               f"{services_dir(Path(deployment.home)) / 'logs'}")
        problem = _health_problem(deployment, api)
        if problem is None:
            return
        time.sleep(1.0)
    raise ServiceError(f"services not healthy after {timeout:.0f}s: {problem}")


def _health_problem(deployment: Deployment, api: AirflowApi) -> str | None:
    import requests

    try:
        requests.get(f"{deployment.mlflow_url}/health", timeout=2).raise_for_status()
    except requests.RequestException:
        return "MLflow server not answering"
    try:
        health = api.health()
    except requests.RequestException:
        return "Airflow API server not answering"
    unhealthy = [k for k, v in health.items()
                 if isinstance(v, dict) and v.get("status") != "healthy"]
    if unhealthy:
        return f"Airflow {', '.join(unhealthy)} not healthy"
    try:
        paused = api.relay_dags_paused()
    except (requests.RequestException, ServiceError) as exc:
        return f"Relay's DAGs not readable yet ({exc})"
    if not paused:
        return "Relay's DAGs not parsed yet"
    for dag_id, is_paused in paused.items():
        if is_paused:
            api.unpause(dag_id)
    return None


def admin_password(home: Path) -> str:
    """Return the admin password the simple auth manager generated."""
    path = services_dir(home) / "passwords.json"
    if not path.exists():
        return ""
    return str(json.loads(path.read_text()).get(ADMIN_USER, ""))


def down(home: Path | None = None, grace: float = 10.0) -> list[int]:
    """Stop the recorded process groups and their descendants; return the PIDs stopped."""
    home = (home or settings.relay_home()).resolve()
    deployment = read_deployment(home)
    if deployment is None:
        return []
    found: set[int] = set()
    groups: list[int] = []
    for name in deployment.pids:  # only what is still Relay's (see _stoppable)
        pids, group = stoppable(deployment, name)
        found.update(pids)
        groups += group
    recorded = {pid: deployment.started.get(name) for name, pid in deployment.pids.items()}
    stopped = stop_pids(sorted(found), groups=groups, grace=grace, started=recorded)
    if deployment.postgres_pid and deployment.same_boot():  # last: Airflow's are its clients
        if pgcluster.stop(deployment.postgres_pid, deployment.postgres_started):
            stopped.append(deployment.postgres_pid)
    ports = [p for p in asdict(deployment.ports).values() if p]
    deadline = time.monotonic() + grace
    while any(port_open(p) for p in ports) and time.monotonic() < deadline:
        time.sleep(0.2)
    state_file(home).unlink(missing_ok=True)
    survivors = stop_workloads(settings.runs_dir(home), residents_dir(home))
    if survivors:
        log.error("make down: processes %s of interrupted DAG runs survived SIGKILL", survivors)
    return stopped


def stop_workloads(runs: Path, residents: Path | None = None) -> list[str]:
    """Stop every attempt, unclaimed standby and resident agent under ``runs`` that has
    processes (a DAG run stopped mid-flight), and every prestarted resident agent in
    ``residents``; mark each attempt let go, so that no task adopts it later. Return the
    PIDs that survived."""
    from relay.launchers.local.adopt import let_go

    launcher = LocalLauncher()
    survivors: list[str] = []
    for handle in runs.rglob(HANDLE_FILE):
        if launcher.has_processes(Attempt(handle.parent)):
            log.info("make down: stopping %s, left by an interrupted DAG run", handle.parent)
            survivors += launcher.stop(Attempt(handle.parent))
            let_go(handle.parent)
    for run_dir in runs.glob("*/*"):  # <dag>/<run>: its residents and unclaimed standbys
        release_run(run_dir)
    for folder in residents.iterdir() if residents is not None and residents.is_dir() else ():
        release(folder)  # prestarted (relay.launchers.local.prestart), taken or not
    return survivors


def print_banner(deployment: Deployment, seconds: float) -> None:
    """Print where everything is and how to log in."""
    home = Path(deployment.home)
    print(f"Relay services up in {seconds:.1f}s (state: {state_file(home)})")
    print(f"  Airflow UI:     {deployment.api_url}  (login: {ADMIN_USER} / "
          f"{admin_password(home)})")
    print(f"  Recovery page:  {deployment.api_url}/relay/")
    print(f"  MLflow UI:      {experiments_url(deployment.mlflow_url)}")
    print(f"  Logs:           {services_dir(home) / 'logs'}")
    print("  Trigger a run:  relay_demo in the UI (Trigger, with a run conf such as "
          '{"chaos": [{"kind": "hang", "segment": 0, "step": 35, "rank": 1}]})')
    print("  Stop:           make down")
