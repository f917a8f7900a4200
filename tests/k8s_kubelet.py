"""Fake kubelets for the fake API server: every pod of a Job run, as rendered, on a namespace host.

No API server or kubelet can run on these machines, so two things here are FAKES:
the API server (tests/k8s_fake.py, which stores and validates what the launcher
sends) and what the cluster's control plane and kubelets do with it (this
module). What runs is real: the Job the launcher rendered, each pod's container
(its command and args, env, volumes, user) built by tests/k8s_pod_host.py inside
a namespace host of ``relay.tools.testbed.hosts`` (its own network, UTS, mount
and PID namespace, address 198.18.0.x on the test bed's bridge).

What :class:`Kubelets` plays, and nothing more:

- the Job controller and the scheduler: for a new Job, one pod per completion
  index (``fake.run_pods``), each on a host of its own (the pods' anti-affinity)
  that no ``nodeAffinity`` ``NotIn`` term excludes and whose labels match the
  ``nodeSelector``; a host whose earlier pod is still ending is not used until it
  has ended (on a cluster each pod has its own IP; here a pod takes its host's);
- each node's kubelet: once the API holds the pod's ConfigMaps and Secrets, their
  items become the volumes' files, ``fieldRef`` (pod name, namespace, node name,
  pod IP, the completion index) and ``secretKeyRef`` env are resolved, and
  ``/etc/hosts`` names the pod (``<job>-<i>.<subdomain>...``) and every other pod
  of the Job under the headless Service (what the cluster's DNS would answer);
  the container starts in the host's network; the pod's phase follows the real
  process (Running, then Succeeded or Failed with its exit code); a pod deleted
  in the API has its container SIGTERMed, then killed after its
  ``terminationGracePeriodSeconds``; each node's Lease renewed;
- the cluster's DNS for Relay's side: :meth:`Kubelets.address` is the pod's IP,
  which the test gives the launcher instead of the Service's DNS name.

Not modelled: cgroups (resources), images, taints, PodDisruption conditions.
"""

from __future__ import annotations

import base64
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k8s_fake import FakeApiServer, stamp
from k8s_pod_host import PodHost

from relay.core import proctree
from relay.tools.testbed.hosts import Host, TestBed

log = logging.getLogger(__name__)

AGENT_MODULE = "relay_train.agent.node"
LEASE_RENEW_SECONDS = 5.0


@dataclass
class PodRun:
    """One pod of a Job on one host: Pending until its container starts."""

    name: str
    job: str
    index: int
    host: Host
    pod: PodHost
    proc: subprocess.Popen[bytes] | None = None
    phase: str = "Pending"
    stopping: bool = False
    log: Path = field(default_factory=Path)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class Kubelets:
    """The control plane's and the kubelets' part, for the hosts of ``bed`` (see the module)."""

    def __init__(self, fake: FakeApiServer, bed: TestBed, work: Path,
                 extra_binds: dict[str, Path] | None = None, namespace: str = "default",
                 poll_seconds: float = 0.1) -> None:
        self.fake, self.bed, self.work, self.namespace = fake, bed, work, namespace
        self.extra_binds = extra_binds or {}
        self.poll_seconds = poll_seconds
        self.pods: dict[str, PodRun] = {}
        self.ended: list[PodRun] = []  # pods whose container ended, oldest first
        self.scheduled: set[str] = set()  # Job uids
        self.lock = threading.Lock()
        self._renewed = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kubelets", daemon=True)
        for name in sorted(bed.hosts):
            fake.add_node(name)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> Kubelets:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop playing, and kill every pod still running (by PID, its whole tree)."""
        self._stop.set()
        self._thread.join(timeout=30)
        for run in list(self.pods.values()):
            self._kill(run)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception:  # a test reads the log; the loop must go on
                log.exception("fake kubelets: sync failed")
            self._stop.wait(self.poll_seconds)

    def sync(self) -> None:
        """Schedule new Jobs, start pods whose objects exist, report and reap containers;
        renew every node's Lease (a kubelet does every 10 s)."""
        if time.monotonic() - self._renewed > LEASE_RENEW_SECONDS:
            self._renewed = time.monotonic()
            for name in self.bed.hosts:
                self.fake.renew_lease(name)
        with self.lock:
            for job in self.fake.items("jobs", self.namespace):
                meta = job["metadata"]
                if meta["uid"] not in self.scheduled and not meta.get("deletionTimestamp"):
                    self._schedule(job)
            for run in list(self.pods.values()):
                self._tend(run)

    # -- Relay's side: the cluster's DNS -----------------------------------------------

    def address(self, job: str, index: int, timeout: float = 60.0) -> str:
        """Return the IP of the Job's pod ``index`` (its host's), once it is scheduled."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                for run in self.pods.values():
                    if run.job == job and run.index == index:
                        return run.host.address
            time.sleep(0.05)
        raise TimeoutError(f"pod {index} of Job {job} not scheduled within {timeout:g}s")

    def host_of(self, job: str, index: int) -> str:
        """Return the host the Job's pod ``index`` runs (or ran) on."""
        for run in [*self.pods.values(), *self.ended]:
            if run.job == job and run.index == index:
                return run.host.name
        raise KeyError(f"no pod {index} of Job {job}")

    def agent_pid(self, job: str, index: int) -> int:
        """Return the PID (in the root namespace) of the agent in the Job's pod ``index``."""
        with self.lock:
            run = next(r for r in self.pods.values() if r.job == job and r.index == index)
        return self._agent_of(run)

    @staticmethod
    def _agent_of(run: PodRun) -> int:
        assert run.proc is not None, f"pod {run.name} has not started"
        for pid in proctree.descendants(run.proc.pid):
            if AGENT_MODULE in _cmdline(pid) and AGENT_MODULE not in _cmdline(_parent(pid)):
                return pid
        raise LookupError(f"no agent process in pod {run.name}")

    # -- the scheduler -------------------------------------------------------------------

    def _eligible(self, spec: dict[str, Any]) -> list[str]:
        """Return the hosts this pod template may go to, in name order (free ones only)."""
        excluded: set[str] = set()
        required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution") or {}
        for term in required.get("nodeSelectorTerms", []):
            for match in term.get("matchFields", []):
                if match["key"] == "metadata.name" and match["operator"] == "NotIn":
                    excluded |= set(match["values"])
        wanted = spec.get("nodeSelector") or {}
        busy = {r.host.name for r in self.pods.values()}
        hosts = []
        for name in sorted(self.bed.hosts):
            labels = (self.fake.get("nodes", name, None) or {}).get("metadata", {}).get(
                "labels", {})
            if name not in excluded | busy and all(labels.get(k) == v
                                                   for k, v in wanted.items()):
                hosts.append(name)
        return hosts

    def _schedule(self, job: dict[str, Any]) -> None:
        name, spec = job["metadata"]["name"], job["spec"]
        template = spec["template"]["spec"]
        hosts = self._eligible(template)[: spec["completions"]]
        if len(hosts) < spec["completions"]:
            return  # pods stay unscheduled until hosts free up (tried again next sync)
        self.scheduled.add(job["metadata"]["uid"])
        names = self.fake.run_pods(name, hosts, phase="Pending", ns=self.namespace)
        subdomain = template.get("subdomain", "")
        addresses = {i: self.bed.hosts[h].address for i, h in enumerate(hosts)}
        for index, (pod_name, host) in enumerate(zip(names, hosts, strict=True)):
            peers: dict[str, str] = {}
            for other, address in addresses.items():
                if other != index and subdomain:
                    short = f"{name}-{other}.{subdomain}"
                    peers.update({short: address, f"{short}.{self.namespace}.svc": address,
                                  f"{short}.{self.namespace}.svc.cluster.local": address})
            work = self.work / pod_name
            work.mkdir(parents=True)
            pod = PodHost(job, index, host, work, extra_binds=dict(self.extra_binds),
                          address=addresses[index], peers=peers, pod_name=pod_name,
                          namespace=self.namespace)
            self.pods[pod_name] = PodRun(pod_name, name, index, self.bed.hosts[host], pod,
                                         log=self.work / f"{pod_name}.log")
            log.info("scheduled pod %s on %s", pod_name, host)

    # -- the kubelet ---------------------------------------------------------------------

    def _volumes_ready(self, run: PodRun) -> bool:
        """Fill the pod's ConfigMap and Secret volumes and secret env from the API; False
        while one is missing (a kubelet keeps the pod in ContainerCreating)."""
        spec = run.pod.pod
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                found = self.fake.get("configmaps", volume["configMap"]["name"], self.namespace)
                if found is None:
                    return False
                folder = run.pod.work / "volumes" / volume["name"]
                folder.mkdir(parents=True, exist_ok=True)
                folder.chmod(0o755)
                for key, value in (found.get("data") or {}).items():
                    (folder / key).write_text(value)
                    (folder / key).chmod(0o644)
                run.pod.folders[volume["name"]] = folder
        wanted = {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        for container in spec["containers"]:
            wanted |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                       if "secretKeyRef" in (e.get("valueFrom") or {})}
        for secret in wanted:
            found = self.fake.get("secrets", secret, self.namespace)
            if found is None:
                return False
            run.pod.secrets[secret] = {k: base64.b64decode(v).decode()
                                       for k, v in (found.get("data") or {}).items()}
        return True

    def _tend(self, run: PodRun) -> None:
        obj = self.fake.get("pods", run.name, self.namespace)
        deleted = obj is None or bool(obj["metadata"].get("deletionTimestamp"))
        if run.proc is None:
            if deleted:
                del self.pods[run.name]
            elif self._volumes_ready(run):
                self._start(run)
            return
        code = run.proc.poll()
        if code is None:
            if deleted and not run.stopping:
                run.stopping = True
                grace = run.pod.pod.get("terminationGracePeriodSeconds", 30)
                threading.Thread(target=self._terminate, args=(run, grace), daemon=True).start()
            return
        if run.phase not in ("Succeeded", "Failed"):
            run.phase = "Succeeded" if code == 0 else "Failed"
            log.info("pod %s on %s: container exited %d", run.name, run.host.name, code)
            self.fake.update_pod(run.name, {"phase": run.phase, "containerStatuses": [{
                "name": "agent", "image": "x", "imageID": "", "ready": False,
                "restartCount": 0, "state": {"terminated": {
                    "exitCode": code, "reason": "Completed" if code == 0 else "Error"}}}]},
                self.namespace)
        del self.pods[run.name]
        self.ended.append(run)

    def _start(self, run: PodRun) -> None:
        argv = run.host.command(run.pod.argv(net=False))
        with run.log.open("ab") as out:
            run.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        run.phase = "Running"
        address = run.host.address
        self.fake.update_pod(run.name, {
            "phase": "Running", "podIP": address, "podIPs": [{"ip": address}],
            "hostIP": address, "startTime": stamp(), "containerStatuses": [{
                "name": "agent", "image": "x", "imageID": "", "ready": True, "restartCount": 0,
                "started": True, "state": {"running": {"startedAt": stamp()}}}]},
            self.namespace)
        log.info("pod %s on %s: container started (pid %d)", run.name, run.host.name,
                 run.proc.pid)

    def _terminate(self, run: PodRun, grace: float) -> None:
        """SIGTERM the container's process, SIGKILL the pod after ``grace`` (the kubelet's)."""
        try:
            os.kill(self._agent_of(run), signal.SIGTERM)
        except (LookupError, OSError):
            pass
        assert run.proc is not None
        try:
            run.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._kill(run)

    def _kill(self, run: PodRun) -> None:
        """SIGKILL the pod's whole process tree (``unshare --kill-child`` ends its PID
        namespace with it)."""
        if run.proc is None:
            return
        tree = [run.proc.pid, *proctree.descendants(run.proc.pid)]
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            run.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.error("pod %s: pid %d outlived SIGKILL", run.name, run.proc.pid)
