"""Namespace hosts on a private bridge: up, run a command on one, down (exactly what was made)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay.core import proctree
from relay.tools.testbed import procs

log = logging.getLogger(__name__)

SUBNET = "198.18.0"  # the benchmarking test range (RFC 2544); never routed anywhere
ROOT_ADDRESS = f"{SUBNET}.1"
ROOT_NAME = "relay-root"  # the root namespace's name in every host's /etc/hosts
LOCK = Path("/run/lock/relay-testbed.lock")
TOOLS = ("ip", "nsenter", "unshare", "mount", "hostname")


class TestBedError(RuntimeError):
    """The test bed could not be made (everything made so far has been removed)."""

    __test__ = False  # not a pytest test class


def can_run_testbed() -> str:
    """Return why namespace hosts cannot run here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root (network, mount, UTS and PID namespaces)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    return f"needs {', '.join(missing)} (iproute2, util-linux)" if missing else ""


@dataclass
class Host:
    """One namespace host. ``home`` is its RELAY_HOME, seen by it alone."""

    name: str
    address: str
    netns: str
    home: str
    pid: int = 0  # the `unshare` process: killing it ends the host (--kill-child)
    started: int | None = None
    init: int = 0  # PID 1 of the host's PID namespace, entered by `run`

    def command(self, argv: list[str]) -> list[str]:
        """Return ``argv`` wrapped to run inside this host's namespaces."""
        return ["nsenter", "-t", str(self.init), "--net", "--uts", "--mount", "--pid", "--", *argv]

    def popen(self, argv: list[str], env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen[str]:
        """Start ``argv`` on this host (RELAY_HOME set to its own folder)."""
        full = {**os.environ, **(env or {}), "RELAY_HOME": self.home}
        return subprocess.Popen(self.command(argv), env=full, text=True,  # type: ignore[call-overload]
                                **kwargs)

    def run(self, argv: list[str], env: dict[str, str] | None = None,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on this host to the end; return its output (not checked)."""
        full = {**os.environ, **(env or {}), "RELAY_HOME": self.home}
        return subprocess.run(self.command(argv), env=full, text=True, capture_output=True,
                              timeout=timeout, check=False)


@dataclass
class TestBed:
    """The bridge, the hosts and the root-side daemons of one test bed, as recorded in ``state``."""

    __test__ = False  # not a pytest test class

    name: str  # the bridge's name, also the prefix of every namespace and veth
    folder: str
    hosts: dict[str, Host] = field(default_factory=dict)
    daemons: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # root-side PIDs
    bridge: bool = False  # set before the bridge is made: `down` removes it if present

    @property
    def state(self) -> Path:
        return Path(self.folder) / "state.json"

    @property
    def hosts_file(self) -> Path:
        return Path(self.folder) / "etc" / "hosts"

    def save(self) -> None:
        """Write the state file (what `down` removes) after every step that made something."""
        doc = {"name": self.name, "folder": self.folder, "daemons": self.daemons,
               "bridge": self.bridge,
               "hosts": {n: asdict(h) for n, h in self.hosts.items()}}
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.state)

    @classmethod
    def load(cls, state: Path) -> TestBed:
        doc = json.loads(state.read_text())
        bed = cls(doc["name"], doc["folder"], bridge=doc["bridge"])
        bed.hosts = {n: Host(**h) for n, h in doc["hosts"].items()}
        bed.daemons = {n: (p[0], p[1]) for n, p in doc["daemons"].items()}
        return bed

    def host(self, name: str) -> Host:
        return self.hosts[name]


def up(names: list[str], first: int = 11, hide: list[str] | None = None) -> TestBed:
    """Make a bridge and one host per name (addresses .first, .first+1, ...); return the bed.

    ``hide`` names folders (e.g. Relay's own RELAY_HOME) covered by an empty tmpfs in every
    host. On any failure, what was made is removed before TestBedError is raised.
    """
    why = can_run_testbed()
    if why:
        raise TestBedError(f"namespace hosts: {why}")
    # A fresh name per bed: other test beds (other engineers, other sessions) may be up too.
    name = f"rly{secrets.token_hex(3)}"
    bed = TestBed(name=name, folder=tempfile.mkdtemp(prefix=f"relay-testbed-{name}-"))
    addresses = {n: f"{SUBNET}.{first + i}" for i, n in enumerate(names)}
    try:
        (Path(bed.folder) / "etc").mkdir()
        bed.save()
        _write_hosts(bed, addresses)
        with _lock():
            _make_bridge(bed)
            for index, name in enumerate(names):
                _make_host(bed, name, addresses[name], index, hide or [])
    except BaseException as err:
        down(bed)
        if isinstance(err, (RuntimeError, OSError, subprocess.SubprocessError)):
            raise TestBedError(f"test bed {bed.name}: {err} (everything made was removed)") from err
        raise
    return bed


def _write_hosts(bed: TestBed, addresses: dict[str, str]) -> None:
    lines = ["127.0.0.1 localhost", f"{ROOT_ADDRESS} {ROOT_NAME}"]
    lines += [f"{address} {name}" for name, address in addresses.items()]
    bed.hosts_file.write_text("\n".join(lines) + "\n")


class _lock:
    """Serialize test beds' setup: each checks 198.18.0.1 is free, then takes it."""

    def __enter__(self) -> None:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _make_bridge(bed: TestBed) -> None:
    taken = procs.run(["ip", "-o", "-4", "addr", "show", "to", f"{SUBNET}.0/24"], "check the range")
    if taken.strip():
        holder = taken.split()[1]
        states = sorted(Path(tempfile.gettempdir()).glob(f"relay-testbed-{holder}-*/state.json"))
        how = (f"`relay testbed down --state {states[0]}`" if states
               else "`make cluster-down`, or remove it by hand")
        raise RuntimeError(f"expected {SUBNET}.0/24 free in the root namespace; found it on "
                           f"{holder} (another test bed?). Stop it first: {how}")
    if Path(f"/sys/class/net/{bed.name}").exists():
        raise RuntimeError(f"expected no link named {bed.name}; found one (not ours: left alone)")
    bed.bridge = True
    bed.save()
    procs.run(["ip", "link", "add", bed.name, "type", "bridge"], "make the bridge")
    procs.run(["ip", "addr", "add", f"{ROOT_ADDRESS}/24", "dev", bed.name], "address the bridge")
    procs.run(["ip", "link", "set", bed.name, "up"], "bring the bridge up")


def _make_host(bed: TestBed, name: str, address: str, index: int, hide: list[str]) -> None:
    netns = f"{bed.name}-{name}"
    hosts_root = Path(bed.folder) / "hosts"
    home = hosts_root / name
    stash = Path(bed.folder) / "stash" / name
    home.mkdir(parents=True)
    stash.mkdir(parents=True)
    host = Host(name=name, address=address, netns=netns, home=str(home))
    bed.hosts[name] = host
    bed.save()
    veth = f"{bed.name}v{index}"
    procs.run(["ip", "netns", "add", netns], f"make host {name}'s network namespace")
    procs.run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns],
              f"make host {name}'s veth")
    procs.run(["ip", "link", "set", veth, "master", bed.name, "up"], f"plug {veth} into the bridge")
    for cmd in (["addr", "add", f"{address}/24", "dev", "eth0"], ["link", "set", "eth0", "up"],
                ["link", "set", "lo", "up"]):
        procs.run(["ip", "-n", netns, *cmd], f"configure host {name}'s eth0")
    # Inside: its hostname; its own folder alone under hosts/ (a tmpfs hides the others);
    # the bed's hosts file over /etc/hosts; ``hide`` covered. Then PID 1 waits forever.
    script = "\n".join([
        "set -e",
        f"hostname {name}",
        f"mount --bind {home} {stash}",
        f"mount -t tmpfs -o mode=755 relay-testbed {hosts_root}",
        f"mkdir {home}",
        f"mount --move {stash} {home}",
        f"mount --bind {bed.hosts_file} /etc/hosts",
        *[f"mount -t tmpfs -o mode=755 relay-testbed-hide {path}" for path in hide],
        "echo ready",
        "exec sleep infinity",
    ])
    proc = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{netns}", "unshare", "--uts", "--mount", "--pid", "--fork",
         "--mount-proc", "--kill-child", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    host.pid, host.started = proc.pid, procs.start_time(proc.pid)
    bed.save()
    assert proc.stdout is not None and proc.stderr is not None
    if proc.stdout.readline().strip() != "ready":
        proc.wait(timeout=10)
        raise RuntimeError(f"host {name} did not start: {proc.stderr.read().strip()}")
    proc.stdout.close()
    proc.stderr.close()
    kids = proctree.descendants(proc.pid)
    if len(kids) != 1:
        raise RuntimeError(f"host {name}: expected one PID 1 under unshare {proc.pid}; "
                           f"found {kids}")
    host.init = kids[0]
    bed.save()


def down(bed: TestBed) -> list[str]:
    """Remove everything ``bed`` names: daemons, hosts (their process trees), namespaces, the
    bridge, the folder. Returns what was removed; safe to call twice.

    Every step is tried even when one fails; then TestBedError names the failures, and the
    folder (with its state file) is kept so that a second `down` can finish the job.
    """
    removed: list[str] = []
    failed: list[str] = []

    def attempt(what: str, step: Callable[[], object]) -> None:
        try:
            if step() is not False:
                removed.append(what)
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            failed.append(f"{what}: {err}")

    for name, (pid, started) in list(bed.daemons.items()):
        attempt(f"{name} (pid {pid})", lambda pid=pid, started=started: procs.stop(pid, started))
    for host in bed.hosts.values():
        if host.pid:
            # `unshare --fork` ignores SIGTERM; SIGKILL ends it, and --kill-child its PID 1,
            # and with it every process of the host's PID namespace.
            attempt(f"host {host.name} (pid {host.pid})",
                    lambda h=host: procs.stop(h.pid, h.started, term=False))
        if Path(f"/run/netns/{host.netns}").exists():
            attempt(f"namespace {host.netns}", lambda h=host: procs.run(
                ["ip", "netns", "del", h.netns], f"remove namespace {h.netns}"))
    if bed.bridge and Path(f"/sys/class/net/{bed.name}").exists():
        attempt(f"bridge {bed.name}", lambda: procs.run(
            ["ip", "link", "del", bed.name], f"remove bridge {bed.name}"))
    if failed:
        raise TestBedError(f"test bed {bed.name} only partly removed ({', '.join(removed)}); "
                           f"failed: {'; '.join(failed)}. State kept in {bed.state}: retry "
                           "`relay testbed down`")
    if Path(bed.folder).exists():
        shutil.rmtree(bed.folder)
        removed.append(f"folder {bed.folder}")
    log.info("test bed %s down: %s", bed.name, ", ".join(removed) or "nothing left")
    return removed


def set_link(bed: TestBed, name: str, up: bool) -> None:
    """Bring host ``name``'s link (its eth0) up or down: a network cut and its repair."""
    state = "up" if up else "down"
    procs.run(["ip", "-n", bed.host(name).netns, "link", "set", "eth0", state],
              f"set host {name}'s link {state}")


def set_qdisc(bed: TestBed, name: str, qdisc: list[str] | None) -> None:
    """Put a root qdisc on host ``name``'s link (its eth0), which then shapes the packets the
    host sends: e.g. ``["tbf", "rate", "1mbit", "burst", "32kbit", "latency", "400ms"]``, a
    slow link whose queue fills (this machine's kernel has no ``netem``); None removes it."""
    netns = bed.host(name).netns
    if qdisc is None:
        procs.run(["tc", "-n", netns, "qdisc", "del", "dev", "eth0", "root"],
                  f"remove the qdisc from host {name}'s link")
        return
    procs.run(["tc", "-n", netns, "qdisc", "add", "dev", "eth0", "root", *qdisc],
              f"add {' '.join(qdisc)} to host {name}'s link")
