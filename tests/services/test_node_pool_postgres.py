"""The node pool shared by two workers on different machines, through PostgreSQL.

Real: Debian's PostgreSQL 15 (a private cluster started by ``relay.tools.pgcluster``, as
`make up` does), and two "workers", each a separate Python process with its OWN
``RELAY_HOME`` (no shared disk) and the same ``RELAY_NODE_POOL_URL``: as Airflow's
Celery or Kubernetes executor runs ``execute`` and ``execute_complete`` on different
machines. `make test-postgres`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest

from relay.core.proctree import alive
from relay.launchers.local.launcher import free_port
from relay.nodes.pool import NodePool
from relay.nodes.store import SqlStore
from relay.tools import pgcluster, services
from relay_train.protocol.pids import start_time

pytestmark = pytest.mark.postgres

NODES = [f"node-{i:02}" for i in range(20)]

# One worker's decisions: wait for the common start, then lease a node for each of its DAG runs.
LEASE = """
import json, sys, time
from relay.nodes.pool import NodePool
name, runs, start_at = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
time.sleep(max(0.0, start_at - time.time()))
print(json.dumps({f"{name}/run-{i}": NodePool().select(1, holder=f"{name}/run-{i}")[0]
                  for i in range(runs)}))
"""
SELECT = """
import json
from relay.nodes.pool import NodePool
pool = NodePool()
print(json.dumps({"chosen": pool.select(3),
                  "held": {n: q.reason for n, q in pool.quarantines().items()}}))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """Start a private PostgreSQL with a ``relay`` database; yield its URL and postmaster PID."""
    home = tmp_path_factory.mktemp("pool-pg")
    root = services.postgres_dir(home)  # a folder the postgres user can reach
    port = free_port()
    pid = pgcluster.start(root, port, home / "postgres.log")
    started = start_time(pid)
    try:
        conn = psycopg2.connect(host="127.0.0.1", port=port, user=pgcluster.PG_USER,
                                dbname=pgcluster.DATABASE)
        conn.autocommit = True
        with conn.cursor() as cur:  # Relay's own database, beside Airflow's on one server
            cur.execute("CREATE DATABASE relay")
        conn.close()
        yield f"postgresql://{pgcluster.PG_USER}@127.0.0.1:{port}/relay", pid
    finally:
        pgcluster.stop(pid, started)
        shutil.rmtree(root, ignore_errors=True)
    assert not alive(pid), "PostgreSQL outlived the test"


def worker_env(home: Path, url: str) -> dict[str, str]:
    """Return the environment of a worker on its own machine: own RELAY_HOME, shared pool."""
    home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "RELAY_HOME": str(home), "RELAY_NODES": ",".join(NODES),
            "RELAY_NODE_POOL_URL": url}


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def test_two_workers_without_a_shared_disk_share_one_pool(
    cluster: tuple[str, int], tmp_path: Path
) -> None:
    url, _ = cluster
    env_a, env_b = worker_env(tmp_path / "a", url), worker_env(tmp_path / "b", url)
    relay = str(Path(sys.executable).with_name("relay"))

    # Worker A decides a quarantine (execute_complete on one machine) ...
    done = run(env_a, relay, "nodes", "quarantine", "node-00", "--for", "30m",
               "--reason", "ECC errors on GPU 3")
    assert done.returncode == 0, done.stderr
    # ... and worker B's next segment (execute on another machine) honours it.
    done = run(env_b, sys.executable, "-c", SELECT)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["held"] == {"node-00": "ECC errors on GPU 3"}
    assert seen["chosen"] == ["node-01", "node-02", "node-03"]

    # Both lease at once, 8 DAG runs each: every run gets its own node, none gets node-00.
    start_at = str(time.time() + 4.0)
    procs = [subprocess.Popen([sys.executable, "-c", LEASE, name, "8", start_at], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, env in (("worker-a", env_a), ("worker-b", env_b))]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    got = {**json.loads(outputs[0][0]), **json.loads(outputs[1][0])}
    assert len(got) == 16
    assert len(set(got.values())) == 16, f"two DAG runs share a node: {got}"
    assert "node-00" not in got.values()

    # The database holds every lease, as each worker wrote it; neither disk holds any state.
    shared = NodePool(nodes=NODES, store=SqlStore(url))
    assert {n: lease["holder"] for n, lease in shared.leases().items()} == {
        node: holder for holder, node in got.items()}
    assert not (tmp_path / "a" / "nodes.json").exists()
    assert not (tmp_path / "b" / "nodes.json").exists()


def test_a_stopped_database_fails_the_worker_with_the_fix(
    cluster: tuple[str, int], tmp_path: Path
) -> None:
    """Runs last: it stops the module's PostgreSQL."""
    url, pid = cluster
    env = worker_env(tmp_path / "a", url)
    pgcluster.stop(pid, start_time(pid))  # the module's own postmaster, running since the fixture
    done = run(env, sys.executable, "-c", SELECT)
    assert done.returncode != 0
    assert "RELAY_NODE_POOL_URL=postgresql://postgres@127.0.0.1:" in done.stderr
    assert "Start the database or fix the URL" in done.stderr
    assert not (tmp_path / "a" / "nodes.json").exists()  # no fallback to this disk
