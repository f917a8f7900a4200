"""The launcher seam: one factory, one protocol, the spec's choice, PIDs only in the local one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relay.core.attempt import AttemptState
from relay.core.exceptions import ConfigError
from relay.core.faults import FaultKind
from relay.launchers import Launcher, LaunchStatus, launcher_for, launcher_from
from relay.launchers.base import NodeStatus, overall_state
from relay.launchers.k8s.launcher import KubernetesLauncher
from relay.launchers.local.launcher import LocalLauncher
from relay.policy.model import Detection
from relay.spec.job import load_job_spec
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay_train.protocol.routes import NodeState

PLUGIN = Path(__file__).resolve().parents[3] / "plugins" / "relay"
BASE = """\
job: k8s
total_steps: 10
steps_per_segment: 5
checkpoint_every: 5
"""


def spec_file(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(BASE + extra)
    return path


def test_local_is_the_default(tmp_path: Path) -> None:
    spec = load_job_spec(spec_file(tmp_path, ""))

    launcher = launcher_for(spec)

    assert spec.launcher == "local" and spec.kubernetes is None
    assert isinstance(launcher, LocalLauncher) and isinstance(launcher, Launcher)
    assert launcher_from(launcher.config()).config() == {"kind": "local"}


def test_kubernetes_from_the_spec_round_trips_through_its_config(tmp_path: Path) -> None:
    spec = load_job_spec(spec_file(tmp_path, (
        "launcher: kubernetes\nkubernetes:\n  image: reg/relay-worker:1\n  namespace: relay\n"
        "  gpus_per_pod: 8\n  active_deadline: 2h\n  taint_quarantine: true\n"
        "  termination_grace: 1m\n")))

    launcher = launcher_for(spec)

    assert isinstance(launcher, KubernetesLauncher) and isinstance(launcher, Launcher)
    settings = launcher.settings
    assert (settings.image, settings.namespace, settings.gpus_per_pod) == (
        "reg/relay-worker:1", "relay", 8)
    assert (settings.active_deadline, settings.taint_quarantine) == (7200.0, True)
    assert settings.termination_grace == 60.0
    assert settings.service_account == "relay-worker"
    rebuilt = launcher_from(launcher.config())
    assert rebuilt.config() == launcher.config()
    assert launcher.slots(["gpu-a", "gpu-b"]) == ["pod-0", "pod-1"]


def test_kubernetes_without_its_section_is_a_clear_spec_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        load_job_spec(spec_file(tmp_path, "launcher: kubernetes\n"))

    text = str(raised.value)
    assert "kubernetes: expected a kubernetes section when launcher is kubernetes" in text
    assert "Fix: add kubernetes: {image:" in text


@pytest.mark.parametrize(("section", "line", "field", "expected"), [
    ("  tolerations:\n  - operator: Exists\n    value: x\n", 9, "kubernetes.tolerations.0",
     "no value with operator Exists"),
    ("  tolerations:\n  - key: spot\n    effect: NoSchedule\n    toleration_seconds: 5\n",
     9, "kubernetes.tolerations.0", "toleration_seconds only with effect NoExecute"),
    ("  tolerations:\n  - key: spot\n    effect: Sometimes\n", 10,
     "kubernetes.tolerations.0.effect", "NoSchedule"),
    ("  node_selector:\n    pool: 'a b'\n", 8, "kubernetes.node_selector", "node labels"),
    ("  termination_grace: 5s\n", 8, "kubernetes.termination_grace", "at least 10 seconds"),
])
def test_a_bad_placement_is_a_spec_error_at_its_line(tmp_path: Path, section: str, line: int,
                                                    field: str, expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_job_spec(spec_file(tmp_path, "launcher: kubernetes\nkubernetes:\n"
                                "  image: reg/relay-worker:1\n" + section))

    text = str(raised.value)
    assert f"{tmp_path / 'job.yaml'}:{line}: {field}" in text, text
    assert expected in text, text


@pytest.mark.parametrize(("before", "field"), [
    ("entrypoint:\n  script: train.py\n", "entrypoint.script"),
    ("entrypoint:\n  module: mypkg.train\n  workdir: work\n", "entrypoint.workdir"),
    ("data:\n  corpus: corpus.txt\n", "data.corpus"),
])
def test_a_path_the_pods_do_not_have_is_a_spec_error(tmp_path: Path, before: str,
                                                     field: str) -> None:
    kubernetes = "launcher: kubernetes\nkubernetes:\n  image: reg/relay-worker:1\n"
    with pytest.raises(ConfigError) as raised:
        load_job_spec(spec_file(tmp_path, before + kubernetes))

    text = str(raised.value)
    assert f"job.yaml:{before.count(chr(10)) + 5}: launcher" in text, text
    assert f"expected {field} as an absolute path inside the worker image" in text, text
    absolute = before.replace("train.py", "/app/train.py").replace("work\n", "/app\n")
    spec = load_job_spec(spec_file(tmp_path, absolute.replace("corpus.txt", "/data/c.txt")
                                   + kubernetes))
    assert spec.launcher == "kubernetes"


def test_unknown_launcher_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="expected 'local', 'kubernetes' or 'slurm', found 'pbs'"):
        launcher_from({"kind": "pbs"})


def test_an_unresponsive_node_from_the_platform_is_node_unresponsive() -> None:
    nodes = {"pod-0": NodeStatus("pod-0", NodeState.RUNNING, host="gpu-1"),
             "pod-1": NodeStatus("pod-1", NodeState.UNRESPONSIVE, detail="node gpu-2 is NotReady",
                                 host="gpu-2")}
    status = LaunchStatus(overall_state(nodes), nodes)
    obs = Observation(now=100.0, launched_at=99.0, heartbeats={},
                      node_ranks={"pod-0": [0, 1], "pod-1": [2, 3]}, heartbeat_interval=0.5,
                      launch=status)

    fault = Detector(Detection()).check(obs)

    assert status.state is AttemptState.RUNNING
    assert fault is not None and fault.kind is FaultKind.NODE_UNRESPONSIVE
    assert (fault.culprit_node, fault.culprit_rank) == ("pod-1", None)
    assert fault.evidence == {"summary": "node gpu-2 is NotReady", "host": "gpu-2"}
    assert Detector(Detection(), frozenset({FaultKind.CRASH})).check(obs) is None


def test_only_the_local_launcher_signals_processes() -> None:
    signalling = re.compile(r"\b(os\.(kill|killpg)|pids\.signal_(process|group))\(")
    users = sorted(str(p.relative_to(PLUGIN)) for p in PLUGIN.rglob("*.py")
                   if signalling.search(p.read_text()))

    # tools/pgcluster.py and core/proctree.py stop the services `make up` started (Airflow,
    # MLflow, PostgreSQL), never a workload; tools/bench/torchrun_baseline.py breaks the
    # benchmark's plain-torchrun baseline (not Relay's); tools/testbed/procs.py ends the test
    # bed's own namespace hosts and daemons (by recorded PID and start time); every signal
    # to a Relay workload goes through LocalLauncher, its chaos hooks and its standby/resident
    # records (a rank's faulthandler is signalled by its own node's agent, asked over the
    # channel).
    assert users == ["core/proctree.py", "launchers/local/launcher.py",
                     "launchers/local/signals.py", "launchers/local/warm_agents.py",
                     "tools/bench/torchrun_baseline.py", "tools/pgcluster.py",
                     "tools/testbed/procs.py"]


def test_the_documented_kubernetes_example_spec_is_valid() -> None:
    example = PLUGIN.parents[1] / "docs" / "examples" / "kubernetes-job.yaml"

    spec = load_job_spec(example)

    assert spec.launcher == "kubernetes" and spec.kubernetes is not None
    assert spec.kubernetes.gpus_per_pod == 8
