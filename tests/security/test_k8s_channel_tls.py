"""TLS on Kubernetes: the pods mount the agents' TLS Secret, the launcher reads the channel CA.

The API server is the FAKE of tests/k8s_fake.py (no cluster here), reached through the
real ``kubernetes`` client; the pods' agents are real TLS agent servers on loopback,
where a cluster would use the headless Service's DNS names (the client checks the
agents' certificate for ``relay-agent`` whatever address it dialled, so it can).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import kubernetes_validate
import pytest
from agents import ServedNode
from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
from channel_certs import Authority, new_authority
from k8s_fake import SCHEMA_VERSION, FakeApiServer
from kubernetes_validate.utils import resources_from_file
from pydantic import ValidationError

from relay.core.attempt import Attempt
from relay.core.exceptions import ChannelCAError, ConfigError
from relay.launchers.k8s.launcher import KubernetesLauncher
from relay.launchers.k8s.objects import (
    AGENT_CONTAINER,
    CHANNEL_TLS_MOUNT,
    AttemptKey,
    agent_url,
    job_manifest,
)
from relay.spec.job import load_job_spec
from relay.spec.sections import KubernetesSpec
from relay_train.agent.server import AgentServer
from relay_train.protocol.channel_tls import AGENT_TLS_NAME
from relay_train.protocol.env import ENV_CHANNEL_TLS_CERT, ENV_CHANNEL_TLS_KEY
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig, attempt_id_of
from relay_train.protocol.routes import NodeState

IMAGE = "registry.example.com/relay-worker:0.1.0"
KEY = AttemptKey("relay_demo", "manual__2026-12-03T05_00_00_00_00", 3, 2)
TLS = {"channel_tls_secret": "relay-channel-tls", "channel_ca_secret": "relay-channel-ca"}
HOSTS = ["gpu-1", "gpu-2"]
DOCS = Path(__file__).resolve().parents[2] / "docs"


def make_launcher(fake: FakeApiServer, tmp_path: Path) -> KubernetesLauncher:
    hook = KubernetesHook(conn_id=None, kubernetes_conn_id=None,
                          config_file=str(fake.kubeconfig(tmp_path / "kubeconfig")))
    return KubernetesLauncher(KubernetesSpec(image=IMAGE, **TLS), hook=hook, retry_wait_seconds=0)


def make_cfg(tmp_path: Path, launcher: KubernetesLauncher) -> LaunchConfig:
    root = tmp_path / "runs" / "relay_k8sdemo" / "run" / "segment-001" / "try-0"
    return LaunchConfig(
        job="k8sdemo", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=20,
        checkpoint_every=10, nodes=launcher.slots(HOSTS), ranks_per_node=2,
        master_addr="127.0.0.1", master_port=1, tracking_uri="http://mlflow:5000",
        run_id="abc", attempt_dir=str(root), attempt=0, segment=1)


def pod_of(spec: KubernetesSpec) -> dict:
    job = job_manifest(KEY, spec, ["pod-0", "pod-1"], 2, [], 1.7e9)
    kubernetes_validate.validate(job, SCHEMA_VERSION, strict=True)
    return job["spec"]["template"]["spec"]


def test_pods_mount_the_agents_tls_secret_read_only_and_name_its_files() -> None:
    pod = pod_of(KubernetesSpec(image=IMAGE))  # TLS is the default

    volumes = {v["name"]: v for v in pod["volumes"]}
    secret = volumes["channel-tls"]["secret"]
    assert secret["secretName"] == "relay-channel-tls"
    assert {i["key"] for i in secret["items"]} == {"tls.crt", "tls.key"}
    agent = next(c for c in pod["containers"] if c["name"] == AGENT_CONTAINER)
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "channel-tls")
    assert mount == {"name": "channel-tls", "mountPath": CHANNEL_TLS_MOUNT, "readOnly": True}
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env[ENV_CHANNEL_TLS_CERT] == f"{CHANNEL_TLS_MOUNT}/tls.crt"
    assert env[ENV_CHANNEL_TLS_KEY] == f"{CHANNEL_TLS_MOUNT}/tls.key"
    assert agent_url(KEY, "relay", 1, tls=True).startswith("https://")


def test_null_secrets_keep_the_channel_clear_and_mount_nothing() -> None:
    pod = pod_of(KubernetesSpec(image=IMAGE, channel_tls_secret=None, channel_ca_secret=None))

    assert "channel-tls" not in {v["name"] for v in pod["volumes"]}
    names = {e["name"] for c in pod["containers"] for e in c["env"]}
    assert ENV_CHANNEL_TLS_CERT not in names and ENV_CHANNEL_TLS_KEY not in names


def test_the_spec_takes_both_secrets_or_neither(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="channel_tls_secret and kubernetes.channel_ca_"
                       "secret both set"):
        KubernetesSpec(image=IMAGE, channel_tls_secret=None)
    example = (DOCS / "examples" / "kubernetes-job.yaml").read_text()
    assert "\nkubernetes:\n" in example
    spec = tmp_path / "job.yaml"
    spec.write_text(example.replace("\nkubernetes:\n",
                                    "\nkubernetes:\n  channel_ca_secret: null\n"))

    with pytest.raises(ConfigError) as refused:
        load_job_spec(spec)

    line = example.split("\nkubernetes:\n")[0].count("\n") + 2
    assert f"{spec}:{line}: kubernetes: expected kubernetes.channel_tls_secret and " in str(
        refused.value)
    assert "found channel_tls_secret: relay-channel-tls, channel_ca_secret: null" in str(
        refused.value)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApiServer]:
    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RELAY_NODES", ",".join(HOSTS))
    server = FakeApiServer().start()
    for host in HOSTS:
        server.add_node(host)
    yield server
    server.stop()


def put_ca_secret(fake: FakeApiServer, ca: Authority, key: str = "ca.crt") -> None:
    code, _ = fake.create("secrets", "default", {
        "metadata": {"name": "relay-channel-ca"},
        "data": {key: base64.b64encode(ca.pem.encode()).decode()}})
    assert code == 201


def test_the_launcher_verifies_the_pods_agents_by_the_ca_from_its_secret(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = new_authority("relay channel CA (test)")
    put_ca_secret(fake, ca)
    cert, key = ca.issue(tmp_path / "pki", AGENT_TLS_NAME)
    monkeypatch.setenv(ENV_CHANNEL_TLS_CERT, str(cert))  # what the pod spec sets
    monkeypatch.setenv(ENV_CHANNEL_TLS_KEY, str(key))
    launcher = make_launcher(fake, tmp_path)
    cfg = make_cfg(tmp_path, launcher)
    name = AttemptKey.from_dir(cfg.root).name
    assert launcher.agent_url(AttemptKey.from_dir(cfg.root), 0) == (
        f"https://{name}-0.{name}.default.svc:29401")
    (cfg.root / "heartbeats").mkdir(parents=True)
    launcher.launch(cfg)
    secret = LaunchConfig.read(cfg.root / LAUNCH_FILE).channel_secret  # what the pods got
    servers = [AgentServer(ServedNode(cfg.root, f"pod-{i}", [2 * i, 2 * i + 1],
                                      attempt_id_of(cfg.root)), "127.0.0.1", 0,
                           secret=secret).start()
               for i in range(2)]
    try:
        monkeypatch.setattr(launcher, "agent_url", lambda _key, i: "https://{}:{}".format(
            *servers[i].address))
        fake.run_pods(name, ["gpu-1", "gpu-2"])

        status = launcher.status(Attempt(cfg.root))

        assert launcher.channel(Attempt(cfg.root)).tls is not None
        assert {n: s.state for n, s in status.nodes.items()} == {
            "pod-0": NodeState.RUNNING, "pod-1": NodeState.RUNNING}
        assert all(s.last_seen is not None for s in status.nodes.values()), (
            "an agent was not heard over TLS")
        assert ("", "secrets", "get") in fake.verbs
    finally:
        for server in servers:
            server.close()


def test_the_shipped_rbac_lets_the_launcher_read_the_ca_secret_and_no_other() -> None:
    rbac = Path(__file__).resolve().parents[2] / "deploy" / "rbac.yaml"
    rules = [rule for doc in resources_from_file(str(rbac)) if doc["kind"].endswith("Role")
             for rule in doc["rules"]
             if "secrets" in rule["resources"] and set(rule["verbs"]) & {"get", "list", "watch"}]
    assert rules == [{"apiGroups": [""], "resources": ["secrets"],
                      "resourceNames": [TLS["channel_ca_secret"]], "verbs": ["get"]}]


@pytest.mark.parametrize("secret", ["missing", "no ca.crt"])
def test_a_launch_without_the_channel_ca_fails_before_any_pod(
    fake: FakeApiServer, tmp_path: Path, secret: str
) -> None:
    if secret == "no ca.crt":
        put_ca_secret(fake, new_authority("x"), key="tls.crt")
    launcher = make_launcher(fake, tmp_path)
    cfg = make_cfg(tmp_path, launcher)

    with pytest.raises(ChannelCAError) as refused:
        launcher.launch(cfg)

    assert "Secret default/relay-channel-ca (kubernetes.channel_ca_secret)" in str(refused.value)
    assert "kubectl -n default create secret generic relay-channel-ca" in str(refused.value)
    assert fake.items("jobs") == [], "pods started that Relay could not have talked to"
