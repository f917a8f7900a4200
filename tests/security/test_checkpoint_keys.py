"""The checkpoint key ring: where it comes from, how it is kept private, how it rotates,
and where it never goes (launch records, a Kubernetes ConfigMap)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
from k8s_fake import FakeApiServer

import relay.operators  # noqa: F401 - registers Airflow's Variable/Connection as the first source
from relay.core import checkpoint_keys as keys_module
from relay.core.checkpoint_keys import KEYS_VARIABLE, checkpoint_keys, ensure_key_file, ring_for
from relay.launchers import launch_record, launcher_from
from relay.launchers.k8s.launcher import KubernetesLauncher
from relay.launchers.k8s.objects import KEYS_MOUNT, KEYS_SECRET, AttemptKey
from relay.spec.sections import KubernetesSpec
from relay_train.protocol.env import ENV_CHECKPOINT_KEYS_FILE
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig
from relay_train.protocol.manifest import CheckpointManifest, CheckpointRef, files_digest
from relay_train.protocol.signing import (
    KEYRING_FILE,
    KeyRing,
    launch_ring,
    sign,
    signature_problem,
)

OLD = "o" * 64
NEW = "n" * 64


def _manifest(step: int = 10) -> CheckpointManifest:
    files = {".metadata": "cd" * 32, "__0_0.distcp": "ef" * 32}
    return CheckpointManifest(step=step, sha256=files_digest(files), size_bytes=5,
                              world_size=2, job="j", run_id="r",
                              parent=CheckpointRef("r0", 5, "12" * 32), created_at=1.5,
                              format="dcp", files=files)


def _cfg(root: Path, ring: KeyRing) -> LaunchConfig:
    return LaunchConfig(job="j", seed=1, model={}, data={}, optimizer={}, start_step=0,
                        end_step=10, checkpoint_every=5, nodes=["node-a"], ranks_per_node=1,
                        tracking_uri="sqlite:///x.db", run_id="r", attempt_dir=str(root),
                        attempt=1, segment=0, checkpoint_keys=ring.to_dict())


def test_the_default_key_file_is_private_from_its_first_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Made with mode 0600 whatever the umask, fully written before its name appears."""
    path = tmp_path / "home" / KEYRING_FILE
    seen: list[tuple[int, str]] = []
    link = os.link

    def watched_link(src: str | Path, dst: str | Path) -> None:
        seen.append((stat.S_IMODE(os.stat(src).st_mode), Path(src).read_text()))
        link(src, dst)

    monkeypatch.setattr(os, "link", watched_link)
    old_umask = os.umask(0)  # a umask that would leave a plain open() world-readable
    try:
        ring = ensure_key_file(path)
    finally:
        os.umask(old_umask)
    assert seen and seen[0][0] == 0o600  # private before it is visible under its name
    assert KeyRing.from_dict(json.loads(seen[0][1])) == ring
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == [KEYRING_FILE]  # no temporary left
    assert ensure_key_file(path) == ring  # created once: later uses read it


def test_processes_racing_to_create_the_key_file_all_end_with_one_key(tmp_path: Path) -> None:
    path = tmp_path / KEYRING_FILE
    code = ("import sys; from pathlib import Path; from relay.core.checkpoint_keys import "
            "ensure_key_file; print(ensure_key_file(Path(sys.argv[1])).keys['k1'])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    secrets = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0] * 4
    assert secrets == {KeyRing.read(path).keys["k1"]}


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / KEYRING_FILE
    ensure_key_file(path)
    path.chmod(0o644)
    with pytest.raises(PermissionError, match=r"expected mode 0600 .* found 0644; run `chmod 600"):
        ensure_key_file(path)


def test_rotation_reads_with_the_old_key_and_writes_with_the_new() -> None:
    before = KeyRing(write="k1", keys={"k1": OLD})
    old = sign(_manifest(10), before)
    rotating = KeyRing(write="k2", keys={"k1": OLD, "k2": NEW})  # step 1: add k2, write with it
    assert signature_problem(old, rotating) is None
    new = sign(_manifest(20), rotating)
    assert new.key_id == "k2" and signature_problem(new, rotating) is None
    after = KeyRing(write="k2", keys={"k2": NEW})  # step 2: once nothing needs k1, drop it
    assert signature_problem(new, after) is None
    assert "signed with key 'k1', which is not among the accepted keys (k2)" in str(
        signature_problem(old, after))


@pytest.mark.parametrize("change", [
    {"step": 11}, {"size_bytes": 6}, {"parent": None}, {"origin": "rescued"},
    {"key_id": "k2"}, {"files": {".metadata": "00" * 32, "__0_0.distcp": "ef" * 32},
                       "sha256": files_digest({".metadata": "00" * 32,
                                               "__0_0.distcp": "ef" * 32})}])
def test_any_change_to_a_signed_manifest_breaks_its_signature(change: dict) -> None:
    ring = KeyRing(write="k1", keys={"k1": OLD, "k2": NEW})
    signed = sign(_manifest(), ring)
    raw = {**json.loads(signed.to_json()), **change}
    forged = CheckpointManifest.from_json(json.dumps(raw))
    assert signature_problem(forged, ring) is not None
    assert signature_problem(CheckpointManifest.from_json(signed.to_json()), ring) is None


def test_an_unsigned_manifest_says_so() -> None:
    problem = signature_problem(_manifest(), KeyRing.generate())
    assert problem is not None and problem.startswith("unsigned: no signature")


def test_a_short_or_missing_writing_key_is_refused_with_the_field() -> None:
    with pytest.raises(ValueError, match="field write: expected the id of one of the keys"):
        KeyRing.from_dict({"write": "k3", "keys": {"k1": OLD}})
    with pytest.raises(ValueError, match="shorter than 32 characters"):
        KeyRing.from_dict({"write": "k1", "keys": {"k1": "secret"}})
    assert OLD not in repr(KeyRing(write="k1", keys={"k1": OLD}))  # never in a log


def test_relay_reads_the_ring_from_airflow_first_then_a_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ring_file = tmp_path / "mounted" / KEYRING_FILE
    ring_file.parent.mkdir()
    ring_file.write_text(json.dumps({"write": "k2", "keys": {"k2": NEW}}))
    monkeypatch.setenv(ENV_CHECKPOINT_KEYS_FILE, str(ring_file))
    assert checkpoint_keys() == KeyRing(write="k2", keys={"k2": NEW})
    monkeypatch.setenv(f"AIRFLOW_VAR_{KEYS_VARIABLE.upper()}",
                       json.dumps({"write": "k1", "keys": {"k1": OLD}}))
    assert checkpoint_keys() == KeyRing(write="k1", keys={"k1": OLD})
    monkeypatch.delenv(f"AIRFLOW_VAR_{KEYS_VARIABLE.upper()}")
    monkeypatch.setenv("AIRFLOW_CONN_RELAY_CHECKPOINT_KEY", json.dumps(
        {"conn_type": "generic", "login": "k3", "password": NEW, "extra": {"read": {"k1": OLD}}}))
    assert checkpoint_keys() == KeyRing(write="k3", keys={"k1": OLD, "k3": NEW})


def test_without_airflow_the_default_file_is_made_under_relay_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_HOME", str(tmp_path))
    monkeypatch.delenv(ENV_CHECKPOINT_KEYS_FILE, raising=False)
    monkeypatch.setattr(keys_module, "_source", None)  # as in the warden: no Airflow
    ring = checkpoint_keys()
    assert KeyRing.read(tmp_path / KEYRING_FILE) == ring


def test_a_rank_finds_the_ring_in_its_launch_file_or_a_mounted_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ring = KeyRing(write="k1", keys={"k1": OLD})
    monkeypatch.delenv(ENV_CHECKPOINT_KEYS_FILE, raising=False)
    assert launch_ring(ring.to_dict()) == ring
    with pytest.raises(ValueError, match=f"found neither.*{ENV_CHECKPOINT_KEYS_FILE}|"
                                         f"{ENV_CHECKPOINT_KEYS_FILE}.*found neither"):
        launch_ring({})
    (tmp_path / KEYRING_FILE).write_text(json.dumps(ring.to_dict()))
    monkeypatch.setenv(ENV_CHECKPOINT_KEYS_FILE, str(tmp_path / KEYRING_FILE))
    assert launch_ring({}) == ring


def test_the_launch_file_holds_the_ring_privately_and_the_launch_record_never(
        tmp_path: Path) -> None:
    ring = KeyRing(write="k1", keys={"k1": OLD})
    cfg = _cfg(tmp_path / "try-1", ring)
    cfg.root.mkdir()
    cfg.write(cfg.root / LAUNCH_FILE)
    assert stat.S_IMODE((cfg.root / LAUNCH_FILE).stat().st_mode) == 0o600
    assert LaunchConfig.read(cfg.root / LAUNCH_FILE).checkpoint_keys == ring.to_dict()
    launcher = launcher_from(None)
    record = launch_record.build(cfg, launcher)
    assert OLD not in json.dumps(record)  # it rides in Airflow's database and its REST API
    restored = launch_record.restore(record, launcher, "sqlite:///x.db")
    assert restored.checkpoint_keys == ring.to_dict()  # from this machine's launch file
    (cfg.root / LAUNCH_FILE).unlink()
    elsewhere = launch_record.restore(record, launcher, "sqlite:///x.db")
    assert elsewhere.checkpoint_keys == {}  # another machine: the deployment's ring (ring_for)


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    server = FakeApiServer().start()
    server.add_node("gpu-1")
    yield server
    server.stop()


def test_kubernetes_pods_mount_the_secret_and_the_configmap_holds_no_key(
        fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RELAY_NODES", "gpu-1")
    hook = KubernetesHook(conn_id=None, kubernetes_conn_id=None,
                          config_file=str(fake.kubeconfig(tmp_path / "kubeconfig")))
    launcher = KubernetesLauncher(KubernetesSpec(image="registry.example.com/relay:0.1",
                                                 channel_tls_secret=None, channel_ca_secret=None),
                                  hook=hook, retry_wait_seconds=0)
    root = tmp_path / "runs" / "relay_k" / "run-1" / "segment-000" / "try-1"
    cfg = replace(_cfg(root, KeyRing(write="k1", keys={"k1": OLD})),
                  nodes=launcher.slots(["gpu-1"]))
    launcher.launch(cfg)
    name = AttemptKey.from_dir(root).name
    configmap = fake.get("configmaps", name)
    assert configmap is not None and OLD not in json.dumps(configmap)
    assert json.loads(configmap["data"][LAUNCH_FILE])["checkpoint_keys"] == {}
    pod = fake.get("jobs", name)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == KEYS_SECRET
    container = pod["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": KEYS_MOUNT, "readOnly": True}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[ENV_CHECKPOINT_KEYS_FILE] == f"{KEYS_MOUNT}/{KEYRING_FILE}"
    assert LaunchConfig.read(root / LAUNCH_FILE).checkpoint_keys  # Airflow's side keeps it


def test_the_warden_never_makes_a_new_key_for_an_attempt_launched_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new key could verify nothing the attempt signed: say what to provide instead."""
    monkeypatch.setenv("RELAY_HOME", str(tmp_path))
    monkeypatch.delenv(ENV_CHECKPOINT_KEYS_FILE, raising=False)
    monkeypatch.setattr(keys_module, "_source", None)
    blank = replace(_cfg(tmp_path / "try-1", KeyRing.generate()), checkpoint_keys={})
    with pytest.raises(FileNotFoundError, match=f"set {ENV_CHECKPOINT_KEYS_FILE}"):
        ring_for(blank)
    assert not (tmp_path / KEYRING_FILE).exists()
    made = checkpoint_keys()  # the segment task (and first use) makes it
    assert ring_for(blank) == made
