"""The test bed's generated Slurm files and its CLI without a test bed (no root needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.tools import cli
from relay.tools.testbed import Host, TestBed, slurm


def _bed(tmp_path: Path) -> TestBed:
    bed = TestBed(name="rlytest", folder=str(tmp_path))
    (tmp_path / "etc").mkdir()
    for i, name in enumerate([slurm.CONTROLLER, "node1", "node2"]):
        bed.hosts[name] = Host(name, f"198.18.0.{10 + i}", f"rlytest-{name}",
                               str(tmp_path / "hosts" / name))
    return bed


def test_slurm_conf_names_the_controller_host_each_node_and_the_pitfall_fixes(
        tmp_path: Path) -> None:
    bed = _bed(tmp_path)
    slurm._write_configs(bed, ["node1", "node2"])
    conf = dict(line.split("=", 1) for line in (tmp_path / "etc" / "slurm.conf").read_text()
                .splitlines() if not line.startswith(("NodeName", "PartitionName")))
    assert conf["SlurmctldHost"] == "slurmctl(198.18.0.10)"
    assert conf["AuthInfo"] == f"socket={tmp_path / 'munge' / 'munge.socket'}"
    assert (conf["ProctrackType"], conf["TaskPlugin"]) == ("proctrack/linuxproc", "task/none")
    assert (conf["SlurmdTimeout"], conf["MessageTimeout"], conf["ReturnToService"]) == (
        "5", "2", "2")
    text = (tmp_path / "etc" / "slurm.conf").read_text()
    assert "NodeName=node2 NodeAddr=198.18.0.12 CPUs=1 State=UNKNOWN" in text
    assert "PartitionName=main Nodes=node1,node2 Default=YES" in text
    cgroup = (tmp_path / "etc" / "cgroup.conf").read_text()
    assert cgroup == f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={tmp_path / 'cgroup-empty'}\n"
    assert slurm.slurm_env(bed) == {"SLURM_CONF": str(tmp_path / "etc" / "slurm.conf")}


def test_the_state_file_round_trips(tmp_path: Path) -> None:
    bed = _bed(tmp_path)
    bed.bridge, bed.daemons["munged"] = True, (123, 456)
    bed.save()
    again = TestBed.load(bed.state)
    assert again == bed


def test_testbed_down_without_a_test_bed_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["testbed", "down"]) == 0
    assert "No test bed is up" in capsys.readouterr().out
    assert cli.main(["testbed", "status"]) == 1
