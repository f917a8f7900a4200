"""The environment Relay runs Airflow with on one machine (demo, tests, benchmarks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from relay.core import settings


def airflow_env(home: Path | None = None) -> dict[str, str]:
    """Return ``os.environ`` plus an embedded Airflow (SQLite, LocalExecutor) under ``home``."""
    home = home or settings.relay_home()
    env = dict(os.environ)
    env.update(
        {
            "RELAY_HOME": str(home),
            "AIRFLOW_HOME": str(home / "airflow"),
            "AIRFLOW__CORE__DAGS_FOLDER": str(settings.REPO_ROOT / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(settings.REPO_ROOT / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "120",
            # Upstream race (apache/airflow#71172, #72716): deferred tasks were
            # marked failed in 6 of 7 standalone runs without this; 15 of 15 with it.
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "1",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "OMP_NUM_THREADS": "1",
        }
    )
    return env


def airflow_bin() -> str:
    """Return the ``airflow`` executable of this interpreter's environment."""
    candidate = Path(sys.executable).with_name("airflow")
    return str(candidate) if candidate.exists() else "airflow"


def ensure_airflow_db(env: dict[str, str], log_file: Path) -> None:
    """Create or upgrade the embedded Airflow database (quietly, into ``log_file``)."""
    Path(env["AIRFLOW_HOME"]).mkdir(parents=True, exist_ok=True)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as out:
        subprocess.run(
            [airflow_bin(), "db", "migrate"], env=env, stdout=out, stderr=subprocess.STDOUT,
            check=True,
        )
