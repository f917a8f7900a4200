"""The `testbed` fixture: three node hosts and a controller host running Slurm (root only)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.tools.testbed import TestBed, hosts, slurm


@pytest.fixture(scope="module")
def testbed(relay_home: Path) -> Iterator[TestBed]:
    """Namespace hosts slurmctl, node1..node3 with Slurm up; Relay's RELAY_HOME hidden in each."""
    why = slurm.can_run_slurm()
    if why:
        pytest.skip(f"Slurm test bed: {why}")
    bed = slurm.up(3, hide=[str(relay_home)])
    try:
        yield bed
    finally:
        hosts.down(bed)
