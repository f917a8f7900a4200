"""A rendered attempt pod trains to its segment's end on a read-only root file system.

The pod is the launcher's own Job manifest (restricted security contexts,
``readOnlyRootFilesystem``, its emptyDirs), run by tests/k8s_pod_host.py as a
kubelet would: this machine's files bound read-only as the image, the volumes
where the manifest mounts them, the launch file from the ConfigMap's data, the
tracking URI from the Secret's, as UID 50000 with no capabilities. Two ranks
meet at the rendered MASTER_ADDR, train, and rank 0 publishes its checkpoint to
MLflow (a SQLite store on a folder standing for the MLflow server, the only
writable place outside the pod's volumes). Any write the agent, its ranks,
torch or MLflow make outside the volumes fails the run.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from k8s_pod_host import PodHost, can_host_pods

from relay.launchers.k8s.access import split_launch
from relay.launchers.k8s.objects import (
    KEYS_SECRET,
    POD_ATTEMPT_DIR,
    RENDEZVOUS_PORT,
    WORKER_UID,
    AttemptKey,
    job_manifest,
    master_addr,
)
from relay.spec.sections import KubernetesSpec
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig, attempt_id_of
from relay_train.protocol.signing import KEYRING_FILE, KeyRing

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(can_host_pods()), reason=can_host_pods() or "ok")]
SERVER = "/mlflow-server"  # where the pod sees the folder that stands for the MLflow server
STEPS = 4


def mlflow_run(server: Path) -> str:
    """Create the segment's MLflow run in a SQLite store the pod reaches at SERVER."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{server}/mlflow.db")
    experiment = client.create_experiment("relay-readonly-pod",
                                          artifact_location=f"{SERVER}/artifacts")
    run_id = client.create_run(experiment).info.run_id
    for path in [server, *server.rglob("*")]:
        os.chown(path, WORKER_UID, WORKER_UID)
    return run_id


def test_a_pod_trains_and_publishes_with_its_root_file_system_read_only(tmp_path: Path) -> None:
    server = tmp_path / "server"
    server.mkdir()
    run_id = mlflow_run(server)
    root = tmp_path / "runs" / "relay_k8sdemo" / "manual__1" / "segment-000" / "try-0"
    key = AttemptKey.from_dir(root)
    cfg = LaunchConfig(
        job="k8sdemo", seed=1, model={"context": 16, "n_layers": 1, "n_heads": 2,
                                      "d_model": 16, "dropout": 0.0},
        data={"corpus": "builtin:python_docs", "batch_size": 4},
        optimizer={"lr": 0.003, "weight_decay": 0.01}, start_step=0, end_step=STEPS,
        checkpoint_every=STEPS, nodes=["pod-0"], ranks_per_node=2,
        tracking_uri=f"sqlite:///{SERVER}/mlflow.db", run_id=run_id, attempt_dir=str(root),
        attempt=0, segment=0, channel_secret=new_secret())
    # What KubernetesLauncher.launch makes of it: the pod's launch data, split.
    pod_cfg = replace(cfg, attempt_dir=POD_ATTEMPT_DIR, master_addr=master_addr(key),
                      master_port=RENDEZVOUS_PORT, attempt_id=attempt_id_of(cfg.root))
    public, secret = split_launch(asdict(pod_cfg))
    job = job_manifest(key, KubernetesSpec(image="relay-worker:test", cpu=2, memory="4Gi",
                                      channel_tls_secret=None, channel_ca_secret=None),
                       cfg.nodes, cfg.ranks_per_node, [], 0.0, sorted(secret))
    launch = tmp_path / "configmap"
    launch.mkdir()
    (launch / LAUNCH_FILE).write_text(json.dumps(public))
    launch.chmod(0o755)
    (launch / LAUNCH_FILE).chmod(0o644)

    ring = KeyRing.generate()  # the deployment's Secret relay-checkpoint-key: rank 0 signs
    secrets = {key.name: secret, KEYS_SECRET: {KEYRING_FILE: json.dumps(ring.to_dict())}}
    host = PodHost(job, 0, "node-a", tmp_path / "pod", secrets=secrets,
                   extra_binds={SERVER: server}, folders={"launch": launch})
    host.work.mkdir()
    done = host.run(timeout=480)

    output = done.stdout + done.stderr
    assert "WRITABLE-ROOT" not in output, output[-4000:]  # the root really is read-only
    assert "READ-ONLY /work" in output and "READ-ONLY /usr" in output, output[-4000:]
    assert done.returncode == 0, output[-6000:]
    published = list((server / "artifacts").rglob("*"))
    assert any(p.is_file() and "checkpoints" in p.parts for p in published), (
        f"no checkpoint published; server holds {published}\n{output[-4000:]}")
