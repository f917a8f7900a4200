"""Test-bed fixtures (root only): `testbed` (three node hosts and a controller host running
Slurm) and `pod_hosts` (three bare node hosts, for Kubernetes pods)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.tools.testbed import TestBed, hosts, slurm
from relay.tools.testbed.lease import lease

RANGE_WAIT_SECONDS = 600.0


@pytest.fixture(scope="module")
def testbed(relay_home: Path) -> Iterator[TestBed]:
    """Namespace hosts slurmctl, node1..node3 with Slurm up; Relay's RELAY_HOME hidden in each."""
    why = slurm.can_run_slurm()
    if why:
        pytest.skip(f"Slurm test bed: {why}")
    with lease():
        bed = slurm.up(3, hide=[str(relay_home)])
        try:
            yield bed
        finally:
            hosts.down(bed)


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
