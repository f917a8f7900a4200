"""The namespace-host test bed and its Slurm cluster: isolation, network, Slurm's basics, gloo."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay.tools.testbed import TestBed, procs, slurm
from relay.tools.testbed.hosts import ROOT_ADDRESS

pytestmark = pytest.mark.cluster_ns
NODES = ["node1", "node2", "node3"]


def _slurm(bed: TestBed, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    done = bed.host(slurm.CONTROLLER).run(list(argv), env=slurm.slurm_env(bed), timeout=timeout)
    assert done.returncode == 0, f"{argv}: {done.stderr}"
    return done


def _until(check: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout:.0f} s"
        time.sleep(0.1)


def test_each_host_has_its_own_name_home_and_hosts_file(testbed: TestBed, relay_home: Path) -> None:
    (relay_home / "relay-side.txt").write_text("Relay's own disk")
    for name in NODES:
        host = testbed.host(name)
        shown = host.run(["sh", "-c", 'hostname; echo "$RELAY_HOME"; cat /etc/hosts']).stdout
        assert shown.splitlines()[:2] == [name, host.home]
        assert f"{host.address} {name}" in shown and "198.18.0.1 relay-root" in shown
        assert host.run(["sh", "-c", f"echo mine > {host.home}/own.txt"]).returncode == 0
        # On the bridge's subnet only: no default route, nothing forwarded.
        routes = host.run(["ip", "route"]).stdout.strip()
        assert routes == f"198.18.0.0/24 dev eth0 proto kernel scope link src {host.address}"
        assert host.run(["cat", "/proc/sys/net/ipv4/ip_forward"]).stdout == "0\n"
        # Relay's RELAY_HOME is an empty tmpfs on the host.
        assert host.run(["ls", "-A", str(relay_home)]).stdout == ""
    for name in NODES:
        others = [testbed.host(n).home for n in NODES if n != name]
        seen = testbed.host(name).run(["ls", *[f"{o}/own.txt" for o in others]])
        assert seen.returncode != 0 and "No such file" in seen.stderr
        own = testbed.host(name).run(["cat", f"{testbed.host(name).home}/own.txt"])
        assert own.stdout == "mine\n"


SERVER = """
import socket
s = socket.create_server(("0.0.0.0", 7777))
print("up", flush=True)
c, _ = s.accept()
print(c.recv(64).decode(), flush=True)
"""
CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), 10)
c.sendall(socket.gethostname().encode())
"""


def test_tcp_host_to_host_and_host_to_root(testbed: TestBed) -> None:
    server = testbed.host("node2").popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        sent = testbed.host("node1").run([sys.executable, "-c", CLIENT, "node2", "7777"])
        assert sent.returncode == 0, sent.stderr
        assert server.stdout.readline().strip() == "node1"
    finally:
        procs.stop(server.pid, procs.start_time(server.pid))
        server.wait()
    with socket.create_server((ROOT_ADDRESS, 0)) as listener:
        port = listener.getsockname()[1]
        sent = testbed.host("node3").run([sys.executable, "-c", CLIENT, "relay-root", str(port)])
        assert sent.returncode == 0, sent.stderr
        listener.settimeout(10)
        conn, (peer, _) = listener.accept()
        with conn:
            assert conn.recv(64) == b"node3" and peer == testbed.host("node3").address


def test_srun_runs_on_two_hosts_and_exclude_is_honoured(testbed: TestBed) -> None:
    ran = _slurm(testbed, "srun", "-N2", "hostname").stdout.split()
    assert len(ran) == 2 and set(ran) <= set(NODES)
    ran = _slurm(testbed, "srun", "-N2", "--exclude=node1", "hostname").stdout.split()
    assert sorted(ran) == ["node2", "node3"]


def test_scancel_ends_a_job(testbed: TestBed) -> None:
    submitted = _slurm(testbed, "sbatch", "--parsable", "-N1", "--wrap", "sleep 600").stdout
    job = submitted.strip().split(";")[0]

    def state() -> str:
        return _slurm(testbed, "squeue", "--noheader", "-j", job, "-o", "%T").stdout.strip()

    _until(lambda: state() == "RUNNING", 30, f"job {job} running")
    node = _slurm(testbed, "squeue", "--noheader", "-j", job, "-o", "%N").stdout.strip()
    # RUNNING in squeue comes before slurmstepd has started the script on the node.
    _until(lambda: "sleep 600" in testbed.host(node).run(["ps", "-eo", "args"]).stdout, 30,
           f"job {job}'s sleep started on {node}")
    _slurm(testbed, "scancel", job)
    _until(lambda: state() == "", 30, f"job {job} gone from squeue")
    _until(lambda: "sleep 600" not in testbed.host(node).run(["ps", "-eo", "args"]).stdout, 30,
           f"job {job}'s sleep ended on {node}")


def test_a_drained_node_shows_drain_with_its_reason(testbed: TestBed) -> None:
    _slurm(testbed, "scontrol", "update", "NodeName=node3", "State=DRAIN",
           "Reason=relay quarantine")
    try:
        assert slurm.states(testbed)["node3"] == "drain"
        reasons = _slurm(testbed, "sinfo", "--noheader", "-R", "-o", "%N|%E").stdout
        assert "node3|relay quarantine" in reasons
    finally:
        _slurm(testbed, "scontrol", "update", "NodeName=node3", "State=RESUME")
    # Resumed, the node is idle again once slurmctld has heard from its slurmd (idle* before).
    slurm.wait_idle(testbed, ["node3"], timeout=30)


GLOO = """
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://node1:29511", rank=rank, world_size=2)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(os.uname().nodename, t.item(), flush=True)
dist.destroy_process_group()
"""


def test_gloo_all_reduce_between_ranks_on_two_hosts(testbed: TestBed) -> None:
    env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    ranks = [testbed.host(f"node{r + 1}").popen([sys.executable, "-c", GLOO, str(r)], env=env,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    try:
        outs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            procs.stop(rank.pid, procs.start_time(rank.pid))
    for r, (out, err) in enumerate(outs):
        assert ranks[r].returncode == 0, err[-2000:]
        assert out.split() == [f"node{r + 1}", "3.0"]
