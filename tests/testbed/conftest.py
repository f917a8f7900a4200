"""Test-bed fixtures (root only): `testbed` (three node hosts and a controller host running
Slurm) and `pod_hosts` (three bare node hosts, for Kubernetes pods)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from airflow_jobs import free_the_pool
from slurm_bed import NODES

from relay.launchers import launcher_from
from relay.launchers.slurm.launcher import SlurmLauncher
from relay.spec.slurm import SlurmSpec
from relay.tools.mlflow_server import mlflow_server
from relay.tools.testbed import TestBed, hosts, slurm
from relay.tools.testbed.hosts import ROOT_ADDRESS, ROOT_NAME
from relay.tools.testbed.lease import lease

RANGE_WAIT_SECONDS = 600.0


@pytest.fixture(scope="module")
def testbed(relay_home: Path) -> Iterator[TestBed]:
    """Namespace hosts slurmctl, node1..node3 with Slurm up; Relay's RELAY_HOME hidden in each."""
    why = slurm.can_run_slurm()
    if why:
        pytest.skip(f"Slurm test bed: {why}")
    # An earlier module's quarantines (the demo's) are in the session's node pool: this
    # fresh cluster would drain those nodes at its first launch.
    free_the_pool()
    with lease():
        bed = slurm.up(3, hide=[str(relay_home)])
        try:
            yield bed
        finally:
            hosts.down(bed)


@pytest.fixture(scope="module")
def tracking(testbed: TestBed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An MLflow server in the root namespace on the bridge; yield its URL as Relay sees it."""
    root = tmp_path_factory.mktemp("mlflow-bridge")
    with mlflow_server(root, host=ROOT_ADDRESS,
                       allowed_hosts=f"{ROOT_NAME}:*,{ROOT_ADDRESS}:*") as url:
        yield url


@pytest.fixture
def launcher(testbed: TestBed, monkeypatch: pytest.MonkeyPatch) -> SlurmLauncher:
    """The Slurm launcher on the bed's cluster (Relay's node pool: node1..node3)."""
    monkeypatch.setenv("RELAY_NODES", ",".join(NODES))
    settings = SlurmSpec(node_home=f"{testbed.folder}/hosts/{{node}}/attempts",
                         python=sys.executable, linger=5.0,
                         slurm_conf=slurm.slurm_env(testbed)["SLURM_CONF"])
    found = launcher_from({"kind": "slurm", **settings.model_dump()})
    assert isinstance(found, SlurmLauncher)
    return found


@pytest.fixture
def pod_hosts(relay_home: Path) -> Iterator[TestBed]:
    """Namespace hosts node1..node3 (no Slurm); Relay's RELAY_HOME hidden in each."""
    why = hosts.can_run_testbed()
    if why:
        pytest.skip(f"namespace hosts: {why}")
    with lease():
        deadline = time.monotonic() + RANGE_WAIT_SECONDS
        while True:  # a bed made without the lease (an older checkout's) may hold the range
            try:
                bed = hosts.up(["node1", "node2", "node3"], hide=[str(relay_home)])
                break
            except hosts.TestBedError as err:
                if "free in the root namespace" not in str(err) or time.monotonic() > deadline:
                    raise
                time.sleep(2)
        try:
            yield bed
        finally:
            hosts.down(bed)
