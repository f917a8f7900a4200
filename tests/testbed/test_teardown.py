"""Tearing the test bed down leaves nothing, also when its setup fails halfway (root only).

A module of its own: only one test bed holds 198.18.0.0/24 at a time, and the `testbed`
fixture of test_testbed.py is down once its module ends.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from relay.tools.testbed import TestBedError, hosts, procs, slurm

pytestmark = pytest.mark.cluster_ns


def _ours() -> tuple[set[str], set[str]]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return ({line.split()[0] for line in netns.splitlines() if line.startswith("rly")},
            set(re.findall(r"^\d+: (rly[0-9a-f]+)\b", links, re.MULTILINE)))


def test_teardown_leaves_no_namespace_bridge_process_or_folder() -> None:
    if slurm.can_run_slurm():
        pytest.skip(slurm.can_run_slurm())
    bed = slurm.up(2)
    try:
        pids = [p for h in bed.hosts.values() for p in [h.pid, *procs.in_pid_namespace(h.init)]]
        made = {(p, procs.start_time(p)) for p in pids} | set(bed.daemons.values())
        names = {Path(f"/proc/{p}/comm").read_text().strip() for p, _ in made}
        assert {"slurmctld", "slurmd", "munged", "unshare"} <= names
        namespaces, links = _ours()
        assert {h.netns for h in bed.hosts.values()} <= namespaces and bed.name in links
    finally:
        hosts.down(bed)
    namespaces, links = _ours()
    assert not {h.netns for h in bed.hosts.values()} & namespaces
    assert not [link for link in links if link.startswith(bed.name)]
    assert not [p for p, started in made if procs.alive(p, started)]
    assert not Path(bed.folder).exists()


def test_a_setup_that_fails_halfway_removes_what_it_made() -> None:
    if hosts.can_run_testbed():
        pytest.skip(hosts.can_run_testbed())
    before = _ours()
    # A host cannot cover a folder that does not exist: the first host's start fails,
    # after the bridge and its namespace were made.
    with pytest.raises(TestBedError, match="host node1 did not start"):
        hosts.up(["node1", "node2"], hide=["/nonexistent/relay-testbed-folder"])
    assert _ours() == before


def test_slurm_that_does_not_come_up_removes_the_hosts_it_ran_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if slurm.can_run_slurm():
        pytest.skip(slurm.can_run_slurm())
    before = _ours()
    folders = set(Path("/tmp").glob("relay-testbed-*"))

    def never_idle(bed: object, names: list[str], timeout: float) -> None:
        raise TestBedError("Slurm did not come up (simulated)")

    monkeypatch.setattr(slurm, "wait_idle", never_idle)
    with pytest.raises(TestBedError, match="simulated"):
        slurm.up(2)
    assert _ours() == before
    assert set(Path("/tmp").glob("relay-testbed-*")) == folders
