"""Where Relay keeps its state on this machine, read from the environment once per call.

``RELAY_HOME`` holds the embedded defaults: the MLflow store, every segment
attempt's folder (launch file, heartbeats, logs) and the node pool. Each
setting can be pointed elsewhere on its own, e.g. a shared volume or an
MLflow server in a cluster.
"""

from __future__ import annotations

import os
from pathlib import Path

from relay_train.protocol.env import ENV_TRACKING_URI

REPO_ROOT = Path(__file__).resolve().parents[3]


def relay_home() -> Path:
    """Return ``$RELAY_HOME`` (default: ``.relay`` in the repository)."""
    return Path(os.environ.get("RELAY_HOME", REPO_ROOT / ".relay")).resolve()


def runs_dir(home: Path | None = None) -> Path:
    """Return where segment attempts keep launch files, heartbeats and logs (of ``home``,
    default ``$RELAY_HOME``)."""
    return Path(os.environ.get("RELAY_RUNS_DIR", (home or relay_home()) / "runs"))


def mlflow_tracking_uri() -> str:
    """Return the MLflow tracking URI (default: SQLite under ``$RELAY_HOME``)."""
    default = f"sqlite:///{relay_home() / 'mlflow' / 'mlflow.db'}"
    return os.environ.get(ENV_TRACKING_URI, default)


def mlflow_artifact_root() -> Path:
    """Return where new experiments keep artifacts (only used for new experiments)."""
    return Path(os.environ.get("RELAY_MLFLOW_ARTIFACT_ROOT", relay_home() / "mlflow" / "artifacts"))


def jobs_dir() -> Path:
    """Return the folder of job specs that the DAG file turns into DAGs."""
    return Path(os.environ.get("RELAY_JOBS_DIR", REPO_ROOT / "dags" / "jobs"))


NODE_POOL_URL_ENV = "RELAY_NODE_POOL_URL"


def node_pool_url() -> str | None:
    """Return the SQLAlchemy URL of the database holding the node pool, or None for the
    default: ``$RELAY_HOME/nodes.json``, which only processes on this machine see."""
    return os.environ.get(NODE_POOL_URL_ENV, "").strip() or None
