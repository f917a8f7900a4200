"""Test-wide setup: every test session gets its own RELAY_HOME and embedded Airflow.

The environment is set at import time, before anything imports Airflow, whose
configuration is read once per process.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_HOME = Path(tempfile.mkdtemp(prefix="relay-test-"))
os.environ["RELAY_HOME"] = str(_HOME)
os.environ.pop("RELAY_JOBS_DIR", None)
os.environ.pop("RELAY_MLFLOW_TRACKING_URI", None)

pytest.register_assert_rewrite("airflow_jobs")

from processes import workload_processes  # noqa: E402

from relay.tools.airflow_env import airflow_env  # noqa: E402 - needs RELAY_HOME set first

os.environ.update(airflow_env(_HOME))


@pytest.fixture(scope="session")
def relay_home() -> Iterator[Path]:
    """Return this session's RELAY_HOME; removed at the end unless RELAY_KEEP_TEST_HOME is set."""
    yield _HOME
    if not os.environ.get("RELAY_KEEP_TEST_HOME"):
        shutil.rmtree(_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_orphans_left_behind() -> Iterator[None]:
    """After each test, SIGKILL any workload it left (a safety net; tests assert their own)."""
    yield
    for pid in workload_processes(_HOME):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
