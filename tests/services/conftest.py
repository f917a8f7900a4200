"""The services of `make up`, started once for every services test of a session.

The deployment is started with `make up`'s own code and stopped with `make down`'s;
afterwards nothing it started may be left: no process, no port, no training process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from airflow_runs import run_to_end
from processes import workload_processes

from relay.core import testhooks
from relay.core.airflow_api import AirflowApi
from relay.core.checkpoint_keys import default_key_file, ensure_key_file
from relay.core.proctree import alive
from relay.tools import services
from relay_train.protocol.env import ENV_CHECKPOINT_KEYS_FILE

PAUSE_DIR = "test-pauses"  # under the deployment's home: see relay.core.testhooks


@pytest.fixture(scope="session")
def deployment(relay_home: Path) -> Iterator[services.Deployment]:
    """Start everything with `make up`'s code; stop it and check nothing is left behind."""
    home = relay_home / "svc"
    # Pause points for the tests that kill a task process mid-record (relay.core.testhooks).
    pauses = home / PAUSE_DIR
    pauses.mkdir(parents=True, exist_ok=True)
    os.environ[testhooks.ENV] = str(pauses)
    began = time.monotonic()
    dep = services.up(home)
    print(f"\nservices up in {time.monotonic() - began:.1f}s")
    saved = os.environ.get("RELAY_MLFLOW_TRACKING_URI")
    os.environ["RELAY_MLFLOW_TRACKING_URI"] = dep.mlflow_url
    # This process reads the deployment's checkpoints too: it gets the deployment's key ring
    # (made here if no component made it yet, as the first of them would).
    keys = default_key_file(home)
    ensure_key_file(keys)
    os.environ[ENV_CHECKPOINT_KEYS_FILE] = str(keys)
    try:
        yield dep
    finally:
        stopped = services.down(home)
        os.environ.pop(testhooks.ENV, None)
        os.environ.pop(ENV_CHECKPOINT_KEYS_FILE, None)
        if saved is None:
            os.environ.pop("RELAY_MLFLOW_TRACKING_URI", None)
        else:
            os.environ["RELAY_MLFLOW_TRACKING_URI"] = saved
    assert stopped, "make down found nothing to stop"
    assert not [p for p in stopped if alive(p)], "processes outlived make down"
    assert not [p for p in (dep.ports.api, dep.ports.mlflow) if services.port_open(p)]
    assert not workload_processes(home), "training processes or wardens outlived make down"


@pytest.fixture(scope="session")
def api(deployment: services.Deployment) -> AirflowApi:
    home = Path(deployment.home)
    return AirflowApi(deployment.api_url, services.ADMIN_USER, services.admin_password(home))


@pytest.fixture(scope="session")
def clean_run(api: AirflowApi) -> str:
    return run_to_end(api, {"chaos": []})
