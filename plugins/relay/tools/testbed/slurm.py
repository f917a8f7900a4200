"""A real Slurm cluster on a test bed: munged (root side), slurmctld on its own host, one slurmd
per node host; generated slurm.conf and cgroup.conf (docs/testing.md says why each setting)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from relay.tools.testbed import hosts, procs
from relay.tools.testbed.hosts import TestBed, TestBedError

CONTROLLER = "slurmctl"
DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "srun", "mungekey")


def can_run_slurm() -> str:
    """Return why Slurm cannot run here ("" when it can)."""
    from shutil import which

    missing = [tool for tool in DAEMONS if which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (`bash scripts/system-deps.sh slurm`)"
    return hosts.can_run_testbed()


def slurm_env(bed: TestBed) -> dict[str, str]:
    """The environment Slurm's clients need (without SLURM_CONF they try a DNS SRV lookup)."""
    return {"SLURM_CONF": str(Path(bed.folder) / "etc" / "slurm.conf")}


def up(nodes: int = 3, timeout: float = 30.0, hide: list[str] | None = None) -> TestBed:
    """Make a test bed with a controller host (.10) and ``nodes`` node hosts (node1 at .11, ...)
    running Slurm; return once every node is idle. On failure everything made is removed."""
    why = can_run_slurm()
    if why:
        raise TestBedError(f"Slurm test bed: {why}")
    names = [f"node{i + 1}" for i in range(nodes)]
    bed = hosts.up([CONTROLLER, *names], first=10, hide=hide)
    try:
        _write_configs(bed, names)
        _start_munge(bed)
        logs = Path(bed.folder) / "logs"
        _start(bed, CONTROLLER, ["slurmctld", "-D", "-i"], logs / "slurmctld.out")
        for name in names:
            start_slurmd(bed, name)
        wait_idle(bed, names, timeout)
    except BaseException:
        hosts.down(bed)
        raise
    return bed


def _write_configs(bed: TestBed, names: list[str]) -> None:
    folder = Path(bed.folder)
    (folder / "logs").mkdir()
    (folder / "cgroup-empty").mkdir()
    (folder / "munge").mkdir(mode=0o755)
    ctl = bed.host(CONTROLLER)
    lines = [
        "ClusterName=relaytestbed",
        f"SlurmctldHost={CONTROLLER}({ctl.address})",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={folder / 'munge' / 'munge.socket'}",
        f"StateSaveLocation={ctl.home}/state",
        f"SlurmctldPidFile={ctl.home}/slurmctld.pid",
        f"SlurmctldLogFile={folder / 'logs' / 'slurmctld.log'}",
        f"SlurmdSpoolDir={folder / 'hosts'}/%n/spool",
        f"SlurmdPidFile={folder / 'hosts'}/%n/slurmd.pid",
        f"SlurmdLogFile={folder / 'logs'}/slurmd-%n.log",
        # No cgroups (`ip netns` hosts have none mounted): processes are tracked by their
        # parent PIDs, and each host's PID namespace contains what escapes that.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "MpiDefault=none",
        "SchedulerType=sched/builtin", "SelectType=select/linear",
        # A lost node is NOT_RESPONDING in seconds, and back by itself when it returns.
        "SlurmdTimeout=5", "MessageTimeout=2", "ReturnToService=2",
        *[f"NodeName={n} NodeAddr={bed.host(n).address} CPUs=1 State=UNKNOWN" for n in names],
        f"PartitionName=main Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP",
    ]
    (folder / "etc" / "slurm.conf").write_text("\n".join(lines) + "\n")
    (folder / "etc" / "cgroup.conf").write_text(
        f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={folder / 'cgroup-empty'}\n")


def _start_munge(bed: TestBed) -> None:
    munge = Path(bed.folder) / "munge"
    key = munge / "munge.key"
    procs.run(["mungekey", "--create", f"--keyfile={key}"], "make the MUNGE key")
    os.chmod(key, 0o600)
    proc = subprocess.Popen(
        ["munged", "--foreground", "--force", f"--socket={munge / 'munge.socket'}",
         f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
         f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    bed.daemons["munged"] = (proc.pid, procs.start_time(proc.pid))
    bed.save()
    _wait(lambda: (munge / "munge.socket").exists() or proc.poll() is not None, 10.0,
          "munged's socket")
    if proc.poll() is not None:
        raise TestBedError(f"munged exited {proc.returncode}; see {munge / 'munged.log'}")


def _start(bed: TestBed, host: str, argv: list[str], out: Path) -> None:
    """Start a daemon on ``host``; it ends with the host (its PID namespace)."""
    with out.open("w") as sink:
        bed.host(host).popen(argv, env=slurm_env(bed), stdout=sink, stderr=subprocess.STDOUT,
                             start_new_session=True)


def start_slurmd(bed: TestBed, node: str) -> None:
    """Start ``node``'s slurmd (at bring-up, or again after a test killed it)."""
    _start(bed, node, ["slurmd", "-D"], Path(bed.folder) / "logs" / f"slurmd-{node}.out")


def states(bed: TestBed) -> dict[str, str]:
    """Return each node's state as `sinfo` prints it (idle, alloc, drain, down*, ...)."""
    done = bed.host(CONTROLLER).run(["sinfo", "--noheader", "--Node", "--format=%N %t"],
                                    env=slurm_env(bed), timeout=15)
    if done.returncode != 0:
        raise TestBedError(f"sinfo exited {done.returncode}: {done.stderr.strip()}")
    return dict(line.split() for line in done.stdout.splitlines() if line.strip())


def wait_idle(bed: TestBed, names: list[str], timeout: float) -> None:
    """Poll `sinfo` until every node in ``names`` is idle; raise naming those that are not."""
    deadline = time.monotonic() + timeout
    seen: dict[str, str] = {}
    error = ""
    while time.monotonic() < deadline:
        try:
            seen, error = states(bed), ""
        except (TestBedError, subprocess.TimeoutExpired) as err:
            error = str(err)
        if all(seen.get(n) == "idle" for n in names):
            return
        time.sleep(0.1)
    late = {n: seen.get(n, "absent") for n in names if seen.get(n) != "idle"}
    raise TestBedError(
        f"Slurm did not come up in {timeout:.0f} s: expected every node idle in sinfo; found "
        f"{late or 'no answer'}{f' ({error})' if error else ''}. Logs: {Path(bed.folder) / 'logs'}")


def _wait(ready: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TestBedError(f"{what} did not appear in {timeout:.0f} s")
        time.sleep(0.05)
