"""Run a rendered Kubernetes pod's container here, as a kubelet and its runtime would.

No Kubernetes can run on these machines, but what a pod's container sees can be
built from Linux namespaces (root only): a fresh mount, PID, network and UTS
namespace; a root file system that is this machine's, bound read-only (the
image, with ``readOnlyRootFilesystem``); the pod's volumes mounted where its
``volumeMounts`` say (an emptyDir is a new tmpfs, a ConfigMap or Secret a
read-only bind of a folder the test fills); ``/etc/hosts`` written as the
kubelet writes it (the pod's hostname and its ``<hostname>.<subdomain>`` name,
which a cluster's DNS would resolve); the env of the container with its
``fieldRef`` and ``secretKeyRef`` values resolved, ``$(VAR)`` expanded in its
args; and the container's user, no capabilities and ``no_new_privs`` via
``setpriv``. The network namespace has only loopback: nothing else can reach
the pod and the pod reaches nothing. Killing the ``unshare`` process ends the
pod (``--kill-child``). Not modelled: seccomp, cgroups (resources), images.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Top-level folders of this machine that become the pod's read-only root file system.
# /root (0700 here) is left out, but the interpreter, which may live there (pyenv), is
# bound on its own: an image's python is readable by its user.
SKIP_ROOT = {"proc", "sys", "dev", "tmp", "run", "relay", "root", "lost+found"}


def can_host_pods() -> str:
    """Return why pods cannot run here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root (mount, PID and network namespaces)"
    for tool in ("unshare", "setpriv", "chroot", "mount", "hostname", "ip"):
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux)"
    return ""


@dataclass
class PodHost:
    """One pod of a rendered Job, made runnable: fill ``folders`` (ConfigMap or Secret
    volumes, by volume name), then :meth:`run`."""

    job: dict[str, Any]
    index: int
    node: str
    work: Path
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # Secret -> key -> value
    extra_binds: dict[str, Path] = field(default_factory=dict)  # path in pod -> host folder
    folders: dict[str, Path] = field(default_factory=dict)
    # On a namespace host (tests/k8s_kubelet.py) the pod shares the host's network: its IP is
    # the host's, and /etc/hosts names its peers (what the cluster's DNS would answer).
    address: str = "127.0.0.1"
    peers: dict[str, str] = field(default_factory=dict)  # DNS name -> address
    pod_name: str = ""
    namespace: str = "default"

    @property
    def pod(self) -> dict[str, Any]:
        return self.job["spec"]["template"]["spec"]

    @property
    def hostname(self) -> str:
        return f"{self.job['metadata']['name']}-{self.index}"

    def env(self, container: dict[str, Any]) -> dict[str, str]:
        """Return the container's env as the kubelet resolves it."""
        annotations = {"batch.kubernetes.io/job-completion-index": str(self.index)}
        resolved: dict[str, str] = {}
        for item in container.get("env", []):
            source = item.get("valueFrom")
            if source is None:
                resolved[item["name"]] = expand(item["value"], resolved)
            elif "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                found = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)
                fields = {"spec.nodeName": self.node, "metadata.name": self.pod_name or
                          self.hostname, "metadata.namespace": self.namespace,
                          "status.podIP": self.address, "status.hostIP": self.address,
                          "spec.serviceAccountName": self.pod.get("serviceAccountName", "")}
                resolved[item["name"]] = annotations[found.group(1)] if found \
                    else fields[path]
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                resolved[item["name"]] = self.secrets[ref["name"]][ref["key"]]
        return resolved

    def script(self, container: dict[str, Any], path_dirs: list[str]) -> str:
        """Return the shell script that builds the pod's root and runs the container."""
        root = self.work / "root"
        volumes = {v["name"]: v for v in self.pod.get("volumes", [])}
        lines = ["set -eu", "mount --make-rprivate /", f"mkdir -p {root}",
                 f"mount -t tmpfs -o mode=755 pod-root {root}"]
        for entry in sorted(os.listdir("/")):
            if entry in SKIP_ROOT or not os.path.isdir(f"/{entry}") or os.path.islink(
                    f"/{entry}"):
                continue
            lines += [f"mkdir {root}/{entry}", f"mount --rbind /{entry} {root}/{entry}"]
        for entry in sorted(os.listdir("/")):  # bin -> usr/bin and the like
            if os.path.islink(f"/{entry}"):
                lines.append(f"ln -s {shlex.quote(os.readlink(f'/{entry}'))} {root}/{entry}")
        interpreter = Path(sys.base_prefix).resolve()
        if interpreter.parts[1:2] == ("root",):
            lines += [f"mkdir -p {root}{interpreter}",
                      f"mount --rbind {interpreter} {root}{interpreter}"]
        lines += [f"mkdir {root}/sys", f"mount --rbind /sys {root}/sys"]
        # Every bound file system read-only, submounts included (the image's layers).
        lines.append(f"for m in $(awk '$2 ~ \"^{root}/\" {{print $2}}' /proc/self/mounts); do "
                     "mount -o remount,bind,ro \"$m\" 2>/dev/null || true; done")
        lines += [f"mkdir {root}/proc {root}/dev {root}/tmp",
                  f"mount -t proc proc {root}/proc",
                  f"mount -t tmpfs -o mode=755 dev {root}/dev"]
        for dev in ("null", "zero", "full", "random", "urandom", "tty"):
            lines += [f"touch {root}/dev/{dev}", f"mount --bind /dev/{dev} {root}/dev/{dev}"]
        hosts = self.work / "hosts"
        subdomain = self.pod.get("subdomain")
        names = f"{self.hostname}.{subdomain} {self.hostname}" if subdomain else self.hostname
        if subdomain:
            names = f"{self.hostname}.{subdomain}.{self.namespace}.svc.cluster.local {names}"
        hosts.write_text(f"127.0.0.1 localhost\n{self.address} {names}\n" + "".join(
            f"{address} {name}\n" for name, address in sorted(self.peers.items())))
        lines += [f"hostname {self.hostname}", f"mount --bind -o ro {hosts} {root}/etc/hosts"]
        for mount in container.get("volumeMounts", []):
            target = f"{root}{mount['mountPath']}"
            volume = volumes[mount["name"]]
            lines.append(f"mkdir -p {target} 2>/dev/null || true")
            if "emptyDir" in volume:
                lines.append(f"mount -t tmpfs -o mode=1777 {mount['name']} {target}")
            else:  # a ConfigMap or Secret: its files, read-only
                lines.append(f"mount --bind -o ro {self._folder(volume)} {target}")
        lines += self._image_under_volumes(root, container)
        for inside, folder in self.extra_binds.items():
            lines += [f"mkdir -p {root}{inside}", f"mount --bind {folder} {root}{inside}"]
        lines += ["mount -o remount,ro " + str(root), "ip link set lo up"]
        sc = {**(self.pod.get("securityContext") or {}),
              **(container.get("securityContext") or {})}
        user = ["setpriv", f"--reuid={sc.get('runAsUser', 0)}",
                f"--regid={sc.get('runAsGroup', 0)}",
                f"--groups={sc.get('fsGroup', sc.get('runAsGroup', 0))}",
                "--inh-caps=-all", "--bounding-set=-all"]
        if sc.get("allowPrivilegeEscalation") is False:
            user.append("--no-new-privs")
        env = self.env(container)
        env.setdefault("PATH", ":".join([*path_dirs, "/usr/local/bin", "/usr/bin", "/bin"]))
        argv = [*container.get("command", []),
                *(expand(a, env) for a in container.get("args", []))]
        run = ["chroot", str(root), *user, "env", "-i",
               *(f"{k}={v}" for k, v in env.items()), *argv]
        probe = ["chroot", str(root), "sh", "-c",  # as root: only read-only mounts stop it
                 "for d in / /etc /usr /work; do if touch $d/.relay-probe 2>/dev/null; "
                 "then echo WRITABLE-ROOT $d; else echo READ-ONLY $d; fi; done"]
        wd = container.get("workingDir")
        lines += [shlex.join(probe), "set +e",
                  (f"cd {shlex.quote(wd)} && " if wd else "") + shlex.join(run), "rc=$?",
                  "echo POD-EXIT $rc",
                  *(f"echo VOLUME {m['mountPath']}; find {root}{m['mountPath']} -maxdepth 3 "
                    "2>/dev/null | head -30" for m in container.get("volumeMounts", [])),
                  f"tail -n 40 {root}/relay/attempt/logs/* 2>/dev/null", "exit $rc"]
        return "\n".join(lines) + "\n"

    @staticmethod
    def _image_under_volumes(root: Path, container: dict[str, Any]) -> list[str]:
        """Bind the project and its Python environment back, read-only, where a volume hides
        them: in a real image they are the image's files, but a checkout under /tmp (CI
        clones one there) is hidden by the pod's /tmp emptyDir."""
        image = {Path(__file__).resolve().parents[1], Path(sys.prefix).resolve()}
        mounts = [Path(m["mountPath"]) for m in container.get("volumeMounts", [])]
        lines: list[str] = []
        for path in sorted(image):
            if any(path.is_relative_to(m) for m in mounts):
                lines += [f"mkdir -p {root}{path}", f"mount --rbind {path} {root}{path}",
                          f"mount -o remount,bind,ro {root}{path}"]
        return lines

    def _folder(self, volume: dict[str, Any]) -> Path:
        """Return the host folder of a ConfigMap or Secret volume (a Secret's from
        ``secrets``, written 0644 like the kubelet's projection)."""
        if volume["name"] in self.folders:
            return self.folders[volume["name"]]
        items = self.secrets[volume["secret"]["secretName"]]
        folder = self.work / "volumes" / volume["name"]
        folder.mkdir(parents=True)
        folder.chmod(0o755)
        for key, value in items.items():
            (folder / key).write_text(value)
            (folder / key).chmod(0o644)
        return folder

    def argv(self, net: bool = True, container_index: int = 0) -> list[str]:
        """Return the command that runs the container in fresh mount, PID and UTS namespaces
        (and a fresh network namespace with only loopback, unless ``net`` is False: then the
        caller's network, e.g. a namespace host's). Killing the ``unshare`` ends the pod."""
        container = self.pod["containers"][container_index]
        script = self.work / "pod.sh"
        script.write_text(self.script(container, [str(Path(sys.executable).parent)]))
        return ["unshare", "--mount", "--pid", *(["--net"] if net else []), "--uts", "--fork",
                "--kill-child", "bash", str(script)]

    def run(self, timeout: float, container_index: int = 0) -> subprocess.CompletedProcess[str]:
        """Run the container to its end (or ``timeout``); return its output and exit code."""
        return subprocess.run(self.argv(container_index=container_index), capture_output=True,
                              text=True, timeout=timeout, check=False)


def expand(text: str, env: dict[str, str]) -> str:
    """Expand ``$(VAR)`` as Kubernetes does in env values, command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)
