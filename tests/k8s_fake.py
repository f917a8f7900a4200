"""A small fake Kubernetes API server for tests: real HTTP, real JSON, on 127.0.0.1.

No real API server can run on these machines, so the Kubernetes launcher is
tested against this one, through the real ``kubernetes`` client and the
provider's ``KubernetesHook``. It speaks the parts of the API Relay uses:
create (409 AlreadyExists), get and list with label selectors (404 NotFound),
watch (chunked JSON lines), delete with foreground/background propagation and
owner-reference garbage collection, merge-patch of nodes with a
resourceVersion precondition (409 Conflict), node Leases. Every object created
is validated against the Kubernetes 1.37 OpenAPI schema (422 if invalid).

What a cluster's controllers and kubelets would do (start pods on nodes, a
node going NotReady or freezing, a pod stuck terminating) the test does
explicitly through the helper methods, and nothing else happens by itself.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import threading
import time
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import kubernetes_validate
from local_http import send_json

SCHEMA_VERSION = "1.37"
INDEX = "batch.kubernetes.io/job-completion-index"
KINDS = {"pods": ("v1", "Pod"), "services": ("v1", "Service"), "configmaps": ("v1", "ConfigMap"),
         "secrets": ("v1", "Secret"), "jobs": ("batch/v1", "Job"), "nodes": ("v1", "Node"),
         "leases": ("coordination.k8s.io/v1", "Lease"),
         "networkpolicies": ("networking.k8s.io/v1", "NetworkPolicy")}
ROUTE = re.compile(
    r"^/(?:api/v1|apis/batch/v1|apis/coordination\.k8s\.io/v1|apis/networking\.k8s\.io/v1)"
    r"(?:/namespaces/(?P<ns>[^/]+))?/"
    r"(?P<res>pods|services|configmaps|secrets|jobs|nodes|leases|networkpolicies)"
    r"(?:/(?P<name>[^/]+))?$"
)


def stamp(epoch: float | None = None) -> str:
    """Return an RFC 3339 timestamp, as the API server writes them."""
    moment = datetime.fromtimestamp(time.time() if epoch is None else epoch, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _matches(obj: dict[str, Any], selector: str | None) -> bool:
    if not selector:
        return True
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in (p.split("=", 1) for p in selector.split(",")))


def _merge(target: Any, patch: Any) -> Any:  # noqa: ANN401 - RFC 7386 JSON merge patch
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


class FakeApiServer:
    """The store, the API's rules, and helpers that play the cluster's controllers."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self.events: list[tuple[int, str, str | None, str, dict[str, Any]]] = []
        self.requests: list[tuple[str, str]] = []
        self.rv = 0
        self.lock = threading.Condition()
        self.frozen_nodes: set[str] = set()  # kubelet not acting: pods never finish terminating
        self.conflicts: dict[str, int] = {}  # node -> how many PATCHes to refuse with 409 first
        self.forbid_node_patch = False  # RBAC without `nodes patch`: PATCH is a 403
        self.slow_nodes: dict[str, float] = {}  # node -> seconds its kubelet takes to stop a pod
        self.watches: list[str] = []  # the resources watched, in order
        self.pod_deletes: list[tuple[str, int | None]] = []  # (pod, grace) of each pod DELETE
        self.verbs: set[tuple[str, str, str]] = set()  # (API group, resource, RBAC verb) used
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    # -- lifecycle -------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Return the server's base URL."""
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeApiServer:
        """Serve in a background thread."""
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and wake every watcher."""
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            self.lock.notify_all()

    def kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig that points the real client at this server."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "relay", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "relay"}}],
        }))
        return path

    # -- the store -----------------------------------------------------------------

    def _put(self, res: str, obj: dict[str, Any], event: str) -> dict[str, Any]:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        key = (res, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if event == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.events.append((self.rv, res, key[1], event, copy.deepcopy(obj)))
        self.lock.notify_all()
        return obj

    def get(self, res: str, name: str, ns: str | None = "default") -> dict[str, Any] | None:
        """Return a stored object, or None."""
        with self.lock:
            found = self.objects.get((res, None if res == "nodes" else ns, name))
            return copy.deepcopy(found)

    def items(self, res: str, ns: str | None = None, selector: str | None = None) -> list[dict]:
        """Return stored objects of one resource."""
        with self.lock:
            return [copy.deepcopy(o) for (r, n, _), o in self.objects.items()
                    if r == res and (ns is None or n == ns) and _matches(o, selector)]

    def create(self, res: str, ns: str | None, body: dict[str, Any]) -> tuple[int, dict]:
        """Create an object as the API server would (validate, 409 if it exists)."""
        api_version, kind = KINDS[res]
        body = {"apiVersion": api_version, "kind": kind, **body}
        try:
            kubernetes_validate.validate(body, SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            return 422, _status(422, "Invalid", f"{kind} is invalid: {exc.message}")
        if kind == "Secret" and "stringData" in body:  # stored base64-encoded, as the API does
            data = body.setdefault("data", {})
            data.update({k: base64.b64encode(v.encode()).decode()
                         for k, v in body.pop("stringData").items()})
        meta = body["metadata"]
        if ns is not None:
            meta["namespace"] = ns
        with self.lock:
            if (res, ns, meta["name"]) in self.objects:
                return 409, _status(409, "AlreadyExists",
                                    f'{res} "{meta["name"]}" already exists')
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", stamp())
            return 201, self._put(res, body, "ADDED")

    def delete(self, res: str, ns: str | None, name: str, policy: str | None,
               grace: int | None) -> tuple[int, dict]:
        """Delete as the API server and garbage collector would."""
        with self.lock:
            obj = self.objects.get((res, ns, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'{res} "{name}" not found')
            if res == "pods":
                self.pod_deletes.append((name, grace))
                return 200, self._delete_pod(obj, grace)
            if policy == "Foreground":
                obj["metadata"]["deletionTimestamp"] = stamp()
                obj["metadata"]["finalizers"] = ["foregroundDeletion"]
                self._put(res, obj, "MODIFIED")
                self._delete_dependents(obj["metadata"]["uid"], grace)
                self._collect()
                return 200, obj
            if policy != "Orphan":
                self._delete_dependents(obj["metadata"]["uid"], grace)
            return 200, self._put(res, obj, "DELETED")

    def _delete_pod(self, pod: dict[str, Any], grace: int | None) -> dict[str, Any]:
        node = pod["spec"].get("nodeName")
        if grace == 0 or node not in self.frozen_nodes | set(self.slow_nodes):
            self._put("pods", pod, "DELETED")
            self._collect()
            return pod
        if node in self.slow_nodes:
            threading.Timer(self.slow_nodes[node], self._finish_pod, [pod]).start()
        period = pod["spec"].get("terminationGracePeriodSeconds", 30) if grace is None else grace
        pod["metadata"]["deletionTimestamp"] = stamp(time.time() + period)
        pod["metadata"]["deletionGracePeriodSeconds"] = period
        return self._put("pods", pod, "MODIFIED")

    def _finish_pod(self, pod: dict[str, Any]) -> None:
        """The kubelet reports the pod's containers gone: the pod object goes."""
        with self.lock:
            key = ("pods", pod["metadata"]["namespace"], pod["metadata"]["name"])
            if key in self.objects:
                self._put("pods", self.objects[key], "DELETED")
                self._collect()

    def _delete_dependents(self, uid: str, grace: int | None) -> None:
        for (res, _, _), obj in list(self.objects.items()):
            owners = obj["metadata"].get("ownerReferences") or []
            if any(o["uid"] == uid for o in owners) and not obj["metadata"].get(
                    "deletionTimestamp"):
                if res == "pods":
                    self._delete_pod(obj, grace)
                else:
                    self._put(res, obj, "DELETED")

    def _collect(self) -> None:
        """Finish foreground deletions whose dependents are all gone."""
        for (res, _, _), obj in list(self.objects.items()):
            if "foregroundDeletion" not in (obj["metadata"].get("finalizers") or []):
                continue
            uid = obj["metadata"]["uid"]
            if not any(any(o["uid"] == uid for o in d["metadata"].get("ownerReferences") or [])
                       for d in self.objects.values()):
                self._put(res, obj, "DELETED")

    def patch_node(self, name: str, patch: dict[str, Any]) -> tuple[int, dict]:
        """Apply a JSON merge patch, honouring a resourceVersion precondition."""
        with self.lock:
            node = self.objects.get(("nodes", None, name))
            if node is None:
                return 404, _status(404, "NotFound", f'nodes "{name}" not found')
            if self.forbid_node_patch:
                return 403, _status(403, "Forbidden", f'nodes "{name}" is forbidden: User '
                                    '"system:serviceaccount:default:relay" cannot patch '
                                    'resource "nodes" in API group "" at the cluster scope')
            wanted = (patch.get("metadata") or {}).get("resourceVersion")
            if self.conflicts.get(name):
                self.conflicts[name] -= 1
                self._put("nodes", node, "MODIFIED")  # someone else changed it meanwhile
            if wanted is not None and wanted != node["metadata"]["resourceVersion"]:
                return 409, _status(409, "Conflict", f'Operation cannot be fulfilled on nodes '
                                    f'"{name}": the object has been modified')
            merged = _merge(node, patch)
            return 200, self._put("nodes", merged, "MODIFIED")

    # -- what the cluster's controllers and kubelets would do -------------------------

    def add_node(self, name: str, ready: bool = True) -> None:
        """Register a node (and its kubelet's Lease)."""
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name}}, "spec": {}, "status": {"conditions": []}}
        with self.lock:
            self.objects[("nodes", None, name)] = node
            self._put("nodes", node, "ADDED")
        self.set_ready(name, ready)
        self.renew_lease(name)

    def set_ready(self, name: str, ready: bool) -> None:
        """Set the node's Ready condition, as the node lifecycle controller does."""
        with self.lock:
            node = self.objects[("nodes", None, name)]
            node["status"]["conditions"] = [{
                "type": "Ready", "status": "True" if ready else "Unknown",
                "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                "lastTransitionTime": stamp(), "lastHeartbeatTime": stamp()}]
            self._put("nodes", node, "MODIFIED")

    def renew_lease(self, name: str) -> None:
        """Renew the node's Lease, as its kubelet does every 10 s."""
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": name, "namespace": "kube-node-lease"},
                 "spec": {"holderIdentity": name, "leaseDurationSeconds": 40,
                          "renewTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}}
        with self.lock:
            self._put("leases", lease, "MODIFIED")

    def run_pods(self, job_name: str, hosts: list[str], phase: str = "Running",
                 ns: str = "default") -> list[str]:
        """Create the Job's pods on ``hosts`` (index i on hosts[i]), as controller + scheduler."""
        with self.lock:
            job = self.objects[("jobs", ns, job_name)]
            template = job["spec"]["template"]
            names = []
            for index, host in enumerate(hosts):
                meta = copy.deepcopy(template["metadata"])
                meta["labels"] = {**meta.get("labels", {}), "job-name": job_name, INDEX: str(index)}
                meta["annotations"] = {INDEX: str(index)}
                meta.update(name=f"{job_name}-{index}-{uuid.uuid4().hex[:5]}", namespace=ns,
                            uid=str(uuid.uuid4()), creationTimestamp=stamp(),
                            ownerReferences=[{"apiVersion": "batch/v1", "kind": "Job",
                                              "name": job_name, "uid": job["metadata"]["uid"],
                                              "controller": True, "blockOwnerDeletion": True}])
                spec = {**copy.deepcopy(template["spec"]), "nodeName": host,
                        "hostname": f"{job_name}-{index}"}
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec,
                       "status": {"phase": phase}}
                self._put("pods", pod, "ADDED")
                names.append(meta["name"])
            return names

    def pod_of(self, job_name: str, index: int, ns: str = "default") -> dict[str, Any]:
        """Return the pod of one completion index."""
        found = [p for p in self.items("pods", ns, f"job-name={job_name}")
                 if p["metadata"]["labels"][INDEX] == str(index)]
        assert found, f"no pod {index} of {job_name}"
        return found[0]

    def set_phase(self, job_name: str, index: int, phase: str, exit_code: int | None = None,
                  ns: str = "default") -> None:
        """Move one pod to ``phase`` (with the agent container's exit code when it ended)."""
        name = self.pod_of(job_name, index, ns)["metadata"]["name"]
        with self.lock:
            pod = self.objects[("pods", ns, name)]
            pod["status"]["phase"] = phase
            if exit_code is not None:
                pod["status"]["containerStatuses"] = [{
                    "name": "agent", "image": "x", "imageID": "", "ready": False,
                    "restartCount": 0, "state": {"terminated": {
                        "exitCode": exit_code, "reason": "Error" if exit_code else "Completed"}}}]
            self._put("pods", pod, "MODIFIED")

    def update_pod(self, name: str, status: dict[str, Any], ns: str = "default") -> bool:
        """Merge ``status`` into a pod's status, as its kubelet reports; False if it is gone."""
        with self.lock:
            pod = self.objects.get(("pods", ns, name))
            if pod is None:
                return False
            pod["status"] = {**pod.get("status", {}), **status}
            self._put("pods", pod, "MODIFIED")
            return True

    def mark_terminating(self, job_name: str, index: int, since_seconds: float,
                         ns: str = "default") -> None:
        """Mark a pod deleted ``since_seconds`` ago whose kubelet never finished the job."""
        name = self.pod_of(job_name, index, ns)["metadata"]["name"]
        with self.lock:
            pod = self.objects[("pods", ns, name)]
            self.frozen_nodes.add(pod["spec"]["nodeName"])
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
            pod["metadata"]["deletionTimestamp"] = stamp(time.time() - since_seconds + grace)
            pod["metadata"]["deletionGracePeriodSeconds"] = grace
            self._put("pods", pod, "MODIFIED")

    def fail_job(self, job_name: str, reason: str, message: str, ns: str = "default") -> None:
        """Set the Job's Failed condition, as the Job controller does."""
        with self.lock:
            job = self.objects[("jobs", ns, job_name)]
            job["status"] = {"conditions": [{"type": "Failed", "status": "True",
                                             "reason": reason, "message": message}]}
            self._put("jobs", job, "MODIFIED")

    # -- HTTP ---------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked watch streams need it

            def log_message(self, *_args: object) -> None:
                return

            def _send(self, code: int, body: dict[str, Any]) -> None:
                send_json(self, code, body)

            def _body(self) -> dict[str, Any]:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length)) if length else {}

            def _route(self) -> tuple[re.Match[str] | None, dict[str, list[str]]]:
                url = urlparse(self.path)
                fake.requests.append((self.command, url.path))
                match, query = ROUTE.match(url.path), parse_qs(url.query)
                if match is not None:
                    group = KINDS[match["res"]][0].rpartition("/")[0]
                    watching = query.get("watch", ["false"])[0].lower() in ("true", "1")
                    verb = {"POST": "create", "DELETE": "delete", "PATCH": "patch"}.get(
                        self.command, "watch" if watching else "get" if match["name"] else "list")
                    fake.verbs.add((group, match["res"], verb))
                return match, query

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                match, query = self._route()
                if match is None:
                    return self._send(404, _status(404, "NotFound", self.path))
                res, ns, name = match["res"], match["ns"], match["name"]
                if name is not None:
                    obj = fake.get(res, name, ns)
                    if obj is None:
                        return self._send(404, _status(404, "NotFound",
                                                       f'{res} "{name}" not found'))
                    return self._send(200, obj)
                selector = query.get("labelSelector", [None])[0]
                if query.get("watch", ["false"])[0].lower() in ("true", "1"):  # Go ParseBool
                    fake.watches.append(res)
                    return self._watch(res, ns, selector, query)
                api_version, kind = KINDS[res]
                with fake.lock:
                    rv = str(fake.rv)
                self._send(200, {"apiVersion": api_version, "kind": f"{kind}List",
                                 "metadata": {"resourceVersion": rv},
                                 "items": fake.items(res, ns, selector)})

            def _watch(self, res: str, ns: str | None, selector: str | None,
                       query: dict[str, list[str]]) -> None:
                since = int(query.get("resourceVersion", ["0"])[0] or 0)
                deadline = time.monotonic() + float(query.get("timeoutSeconds", ["5"])[0])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    self._stream(res, ns, selector, since, deadline)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client stopped watching: fine

            def _stream(self, res: str, ns: str | None, selector: str | None, since: int,
                        deadline: float) -> None:
                while time.monotonic() < deadline:
                    with fake.lock:
                        batch = [(rv, ev, obj) for rv, r, n, ev, obj in fake.events
                                 if rv > since and r == res and (ns is None or n == ns)
                                 and _matches(obj, selector)]
                        if not batch:
                            fake.lock.wait(max(0.0, min(0.2, deadline - time.monotonic())))
                    for rv, event, obj in batch:
                        line = json.dumps({"type": event, "object": obj}).encode() + b"\n"
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                        self.wfile.flush()
                        since = rv
                self.wfile.write(b"0\r\n\r\n")

            def do_POST(self) -> None:  # noqa: N802
                match, _ = self._route()
                if match is None or match["name"] is not None:
                    return self._send(405, _status(405, "MethodNotAllowed", self.path))
                self._send(*fake.create(match["res"], match["ns"], self._body()))

            def do_DELETE(self) -> None:  # noqa: N802
                match, query = self._route()
                body = self._body()
                grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds", [None])[0])
                if match is None or match["name"] is None:
                    return self._send(405, _status(405, "MethodNotAllowed", self.path))
                self._send(*fake.delete(match["res"], match["ns"], match["name"],
                                        body.get("propagationPolicy"),
                                        None if grace is None else int(grace)))

            def do_PATCH(self) -> None:  # noqa: N802
                match, _ = self._route()
                kind = self.headers.get("Content-Type")
                if match is None or match["res"] != "nodes" or match["name"] is None:
                    return self._send(405, _status(405, "MethodNotAllowed", self.path))
                if kind != "application/merge-patch+json":
                    return self._send(415, _status(415, "UnsupportedMediaType", str(kind)))
                self._send(*fake.patch_node(match["name"], self._body()))

        return Handler
