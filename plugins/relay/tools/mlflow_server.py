"""A real MLflow tracking server as `make up` starts it (its own artifact store, served),
stopped by PID with every process it started: for tests and the demo on the Slurm test bed
(listening on the bridge)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from relay.core.proctree import descendants, stop_pids
from relay.tools.services import free_port


def _allowed(host: str, port: int, allowed_hosts: str) -> list[str]:
    """Return the --allowed-hosts argument: ``allowed_hosts``, else ``host`` off loopback."""
    if allowed_hosts:
        return ["--allowed-hosts", allowed_hosts]
    return ["--allowed-hosts", f"{host},{host}:{port}"] if host != "127.0.0.1" else []


@contextlib.contextmanager
def mlflow_server(root: Path, timeout: float = 180.0, host: str = "127.0.0.1",
                  allowed_hosts: str = "") -> Iterator[str]:
    """Run an MLflow server storing under ``root``, listening on ``host`` (answering requests
    whose Host header ``allowed_hosts`` allows, besides its defaults); yield its URL once it
    answers."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = None
    try:
        while True:  # another process may take the free port first: pick again
            port = free_port()
            proc = subprocess.Popen(
                [str(Path(sys.executable).with_name("mlflow")), "server", "--host",
                 host, "--port", str(port), "--workers", "1",
                 *_allowed(host, port, allowed_hosts),
                 "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                 "--artifacts-destination", str(root / "artifacts"), "--serve-artifacts"],
                env=env, stdout=(root / "server.log").open("ab"), stderr=subprocess.STDOUT,
                start_new_session=True)
            url = f"http://{host}:{port}"
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2):
                        break
                except OSError:
                    time.sleep(0.5)
            if proc.poll() is None:
                break
            if time.monotonic() >= deadline:
                break
        if time.monotonic() >= deadline:
            raise RuntimeError(f"mlflow server on {host}: expected it to answer {url}/health "
                               f"within {timeout:.0f} s, found no answer. Read "
                               f"{root / 'server.log'}")
        yield url
    finally:
        if proc is not None:
            stop_pids([proc.pid, *descendants(proc.pid)], groups=[proc.pid], grace=10)
            proc.wait(timeout=30)
