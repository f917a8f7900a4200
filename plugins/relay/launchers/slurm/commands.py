"""Every Slurm call Relay makes, and the parsing of their machine-readable output.

Relay's side runs Slurm's client commands (``sbatch``, ``scontrol``, ``scancel``) with
the operator's ``SLURM_CONF`` and MUNGE; it reads one-record-a-line output
(``scontrol show ... -o``: ``Key=value`` pairs), since Debian's Slurm 22.05 has no
``--json`` in ``scontrol``. Every call has a timeout: a client without ``SLURM_CONF``
falls back to a DNS SRV lookup and can hang, and an unreachable slurmctld makes the
clients retry. A failed call raises :class:`SlurmError`, saying what was expected,
what was found and what to do.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass

log = logging.getLogger("relay.launchers.slurm.launcher")  # the launcher's log: one place

CALL_TIMEOUT_SECONDS = 20.0
# Node states (base state or a flag of ``State=``) that make a node unfit: a node of a running
# attempt in one of UNRESPONSIVE is a node fault; one in UNFIT is left out of new attempts.
UNRESPONSIVE = frozenset({"DOWN", "NOT_RESPONDING", "FAIL", "FAILING"})
UNFIT = UNRESPONSIVE | {"DRAIN", "DRAINED", "DRAINING", "MAINT", "REBOOT_ISSUED"}
# Job states after which no task of the job runs any more.
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT"})
# What scancel says of a job that is over (nothing left to signal).
GONE = ("Invalid job id", "already completing or completed", "Job/step already")
_KEY = re.compile(r"\s+(?=[A-Za-z][A-Za-z0-9_:/.]*=)")


class SlurmError(RuntimeError):
    """A Slurm command was missing, did not answer, or refused."""


@dataclass(frozen=True)
class SlurmJob:
    """What ``scontrol show job -o`` says of one job."""

    job_id: str
    name: str
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, NODE_FAIL, ...
    reason: str
    comment: str  # Relay puts the attempt's id here (the handle's fence)
    nodes: list[str]  # allocated nodes, expanded
    exit_code: str

    @property
    def ended(self) -> bool:
        """Return whether no task of the job runs any more."""
        return self.state in ENDED


@dataclass(frozen=True)
class SlurmNode:
    """What ``scontrol show node -o`` says of one node."""

    name: str
    address: str
    states: frozenset[str]  # the base state and its flags: {"IDLE", "DRAIN"}, {"DOWN", ...}
    reason: str

    @property
    def unresponsive(self) -> str | None:
        """Return why Slurm says the node is lost (DOWN, NOT_RESPONDING, FAIL), or None."""
        bad = sorted(self.states & UNRESPONSIVE)
        if not bad:
            return None
        why = f" ({self.reason})" if self.reason else ""
        return f"Slurm reports node {self.name} {'+'.join(bad)}{why}"

    @property
    def unfit(self) -> bool:
        """Return whether a new attempt must leave the node out (lost or drained)."""
        return bool(self.states & UNFIT)


def parse_record(line: str) -> dict[str, str]:
    """Return the ``Key=value`` pairs of one ``-o`` line (a value may hold spaces: a reason)."""
    fields: dict[str, str] = {}
    for part in _KEY.split(line.strip()):
        key, sep, value = part.partition("=")
        if sep:
            fields[key] = value.strip()
    return fields


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list (``node[1,3-4],gpu7``) into names; "" and (null): none."""
    if text in ("", "(null)", "None"):
        return []
    names: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", text):
        if plain:
            names.append(plain)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not high:
                names.append(prefix + low)
                continue
            names += [f"{prefix}{i:0{len(low)}d}" for i in range(int(low), int(high) + 1)]
    return names


def parse_job(line: str) -> SlurmJob:
    """Return the job of one ``scontrol show job -o`` line."""
    f = parse_record(line)
    if "JobId" not in f or "JobState" not in f:
        raise SlurmError(f"scontrol show job: expected a line with JobId= and JobState=; found "
                         f"{line[:200]!r}. Check the Slurm client's version (22.05 or later)")
    return SlurmJob(job_id=f["JobId"], name=f.get("JobName", ""), state=f["JobState"],
                    reason=f.get("Reason", ""), comment=f.get("Comment", ""),
                    nodes=expand_hostlist(f.get("NodeList", "")),
                    exit_code=f.get("ExitCode", ""))


def parse_node(line: str) -> SlurmNode:
    """Return the node of one ``scontrol show node -o`` line."""
    f = parse_record(line)
    if "NodeName" not in f or "State" not in f:
        raise SlurmError(f"scontrol show node: expected a line with NodeName= and State=; "
                         f"found {line[:200]!r}")
    states = frozenset(s for s in f["State"].rstrip("*").split("+") if s)
    if f["State"].endswith("*"):
        states |= {"NOT_RESPONDING"}
    reason = re.sub(r"\s*\[[^\]]*@[^\]]*\]$", "", f.get("Reason", ""))  # "[root@time]"
    return SlurmNode(name=f["NodeName"], address=f.get("NodeAddr", f["NodeName"]),
                     states=states, reason="" if reason == "(null)" else reason)


def run(argv: list[str], env: dict[str, str] | None = None,
        stdin: str | None = None, timeout: float = CALL_TIMEOUT_SECONDS) -> str:
    """Run one Slurm client command; return its stdout, or raise :class:`SlurmError`."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(f"{argv[0]}: expected Slurm's client commands on PATH on the machine "
                         f"Relay's tasks run on; found no {argv[0]}. Install slurm-client "
                         "(Debian: apt-get install slurm-client; it must match the cluster's "
                         "Slurm) and the cluster's slurm.conf and MUNGE key")
    try:
        done = subprocess.run(argv, input=stdin, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired as err:
        raise SlurmError(f"{' '.join(argv[:3])}: expected an answer from slurmctld within "
                         f"{timeout:g}s; found none. Check SLURM_CONF names the cluster's "
                         "slurm.conf, that slurmctld runs and is reachable from this machine "
                         "(`scontrol ping`), and munged runs here") from err
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        hint = ("slurmctld is not reachable: check it runs (`scontrol ping`) and SLURM_CONF"
                if "Unable to contact" in said or "Connection refused" in said
                else "see Slurm's message")
        raise SlurmError(f"{' '.join(argv[:3])}: expected exit 0; found {done.returncode}: "
                         f"{said[:400]} ({hint})")
    return done.stdout


class Slurm:
    """The Slurm cluster, through its client commands (``env``: e.g. SLURM_CONF)."""

    def __init__(self, env: dict[str, str] | None = None,
                 timeout: float = CALL_TIMEOUT_SECONDS) -> None:
        self.env = env
        self.timeout = timeout

    def _run(self, argv: list[str], stdin: str | None = None) -> str:
        return run(argv, self.env, stdin, self.timeout)

    def submit(self, script: str, options: list[str]) -> str:
        """Submit a batch script (given on stdin, so it is never a file on Relay's disk);
        return the job id."""
        out = self._run(["sbatch", "--parsable", *options], stdin=script).strip()
        job_id = out.split(";")[0]  # "ID" or "ID;cluster"
        if not job_id.isdigit():
            raise SlurmError(f"sbatch --parsable: expected a job id; found {out[:200]!r}")
        return job_id

    def job(self, job_id: str) -> SlurmJob | None:
        """Return the job, or None once slurmctld has forgotten it (MinJobAge after its end)."""
        try:
            out = self._run(["scontrol", "show", "job", "-o", job_id])
        except SlurmError as err:
            if "Invalid job id" in str(err):
                return None
            raise
        lines = [line for line in out.splitlines() if line.strip()]
        return parse_job(lines[0]) if lines else None

    def nodes(self) -> dict[str, SlurmNode]:
        """Return every node of the cluster by name."""
        out = self._run(["scontrol", "show", "node", "-o"])
        found = [parse_node(line) for line in out.splitlines() if line.strip()]
        return {n.name: n for n in found}

    def cancel(self, job_id: str, signal: str | None = None) -> None:
        """Signal every process of the job, batch shell included (``signal``), or end it."""
        argv = ["scancel", "--full", "-s", signal, job_id] if signal else ["scancel", job_id]
        try:
            self._run(argv)
        except SlurmError as err:
            if not any(gone in str(err) for gone in GONE):
                raise
            log.info("Slurm job %s: already over (%s)", job_id, err)

    def drain(self, node: str, reason: str) -> None:
        """Drain ``node`` in Slurm with ``reason`` (running jobs finish; no new ones start)."""
        self._run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])

    def resume(self, node: str) -> None:
        """Let a drained node take jobs again."""
        self._run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
