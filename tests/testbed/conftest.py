"""The `testbed` fixture: three node hosts and a controller host running Slurm (root only)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.tools.testbed import TestBed, hosts, slurm

LEASE = Path("/run/lock/relay-testbed-lease.lock")  # held while a test's bed is up


@pytest.fixture(scope="module")
def testbed(relay_home: Path) -> Iterator[TestBed]:
    """Namespace hosts slurmctl, node1..node3 with Slurm up; Relay's RELAY_HOME hidden in each."""
    why = slurm.can_run_slurm()
    if why:
        pytest.skip(f"Slurm test bed: {why}")
    # One bed per machine (they share 198.18.0.0/24): wait for another test's bed to go.
    LEASE.parent.mkdir(parents=True, exist_ok=True)
    lease = os.open(LEASE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lease, fcntl.LOCK_EX)
        bed = slurm.up(3, hide=[str(relay_home)])
        try:
            yield bed
        finally:
            hosts.down(bed)
    finally:
        os.close(lease)
