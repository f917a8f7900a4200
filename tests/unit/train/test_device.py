"""Unit tests for relay_train.device: backend choice, rank device, rank environment, fork safety.

This machine has no GPU and a CPU-only torch. Every CUDA branch below runs
against a FAKE CUDA: ``torch.cuda.*`` and ``torch.distributed.is_nccl_available``
are monkeypatched, so these tests check Relay's decisions and calls, not that
NCCL or a GPU really works (``relay doctor`` checks that on a GPU node). The
CPU branches run real torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from relay_train import device as dev
from relay_train.errors import DeviceError


class FakeCuda:
    """Stands in for torch.cuda on a machine with ``count`` GPUs; records what was called."""

    def __init__(self, count: int, *, initialized: bool = False) -> None:
        self.count = count
        self.initialized = initialized
        self.current: torch.device | None = None
        self.synchronized: list[torch.device] = []

    def install(self, monkeypatch: pytest.MonkeyPatch, *, nccl: bool = True) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(torch.cuda, "set_device", self._set_device)
        monkeypatch.setattr(torch.cuda, "current_stream", self._current_stream)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
        return self

    def _set_device(self, device: torch.device) -> None:
        self.current = device

    def _current_stream(self, device: torch.device) -> Any:  # noqa: ANN401
        fake = self

        class Stream:
            def synchronize(self) -> None:
                fake.synchronized.append(device)

        return Stream()


@pytest.fixture
def no_determinism(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record use_deterministic_algorithms calls instead of changing this process's torch."""
    calls: list[bool] = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", calls.append)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    return calls


# -- backend choice -------------------------------------------------------------------


def test_auto_is_gloo_on_this_cpu_machine() -> None:
    """Real torch here: no CUDA, so auto must fall back to gloo."""
    assert not torch.cuda.is_available()
    assert dev.resolve_backend("auto", 2) == "gloo"


@pytest.mark.parametrize(
    ("gpus", "nccl", "local_world", "expected"),
    [
        (4, True, 4, "nccl"),   # one GPU per local rank
        (8, True, 2, "nccl"),
        (2, True, 4, "gloo"),   # fewer GPUs than local ranks
        (4, False, 4, "gloo"),  # CUDA build without NCCL
        (0, True, 1, "gloo"),
    ],
)
def test_auto_with_fake_cuda(
    monkeypatch: pytest.MonkeyPatch, gpus: int, nccl: bool, local_world: int, expected: str
) -> None:
    """FAKE CUDA: auto picks NCCL only with enough GPUs and NCCL present."""
    FakeCuda(gpus).install(monkeypatch, nccl=nccl)
    assert dev.resolve_backend("auto", local_world) == expected


def test_gloo_forced_on_a_gpu_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE CUDA: backend: gloo wins even with GPUs."""
    FakeCuda(8).install(monkeypatch)
    assert dev.resolve_backend("gloo", 8) == "gloo"


def test_nccl_forced_without_cuda_says_expected_found_fix() -> None:
    with pytest.raises(DeviceError) as err:
        dev.resolve_backend("nccl", 2)
    message = str(err.value)
    assert "expected a CUDA build of torch with NCCL and at least 2 GPU(s)" in message
    assert "found no CUDA device is visible" in message
    assert "fix:" in message and "backend: auto" in message


def test_nccl_forced_with_too_few_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE CUDA: 2 GPUs cannot host 4 NCCL ranks."""
    FakeCuda(2).install(monkeypatch)
    with pytest.raises(DeviceError, match=r"found 2 CUDA device\(s\) for 4 local rank"):
        dev.resolve_backend("nccl", 4)


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(DeviceError, match="expected one of auto, gloo, nccl; found 'mpi'"):
        dev.resolve_backend("mpi", 1)


# -- the rank's device and DDP arguments ----------------------------------------------


def test_cpu_rank_device_and_no_ddp_kwargs(no_determinism: list[bool]) -> None:
    rank = dev.setup_rank_device("auto", local_rank=1, local_world_size=2, deterministic=True)
    assert rank.backend == "gloo"
    assert rank.device == torch.device("cpu")
    assert rank.ddp_kwargs == {}
    assert rank.deterministic is False  # nothing to turn on for CPU
    assert no_determinism == []


def test_cuda_rank_device_binds_local_rank(
    monkeypatch: pytest.MonkeyPatch, no_determinism: list[bool]
) -> None:
    """FAKE CUDA: rank with LOCAL_RANK 3 gets cuda:3, set as current, and DDP device ids."""
    cuda = FakeCuda(4).install(monkeypatch)
    rank = dev.setup_rank_device("auto", local_rank=3, local_world_size=4, deterministic=False)
    assert rank.backend == "nccl"
    assert rank.device == torch.device("cuda", 3)
    assert cuda.current == torch.device("cuda", 3)
    assert rank.ddp_kwargs == {"device_ids": [3], "output_device": 3}
    assert no_determinism == []


def test_deterministic_on_cuda(monkeypatch: pytest.MonkeyPatch, no_determinism: list[bool]) -> None:
    """FAKE CUDA: bit-exact resume turns on deterministic algorithms, cuDNN and cuBLAS config."""
    FakeCuda(2).install(monkeypatch)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    rank = dev.setup_rank_device("nccl", local_rank=0, local_world_size=2, deterministic=True)
    assert rank.deterministic is True
    assert no_determinism == [True]
    assert torch.backends.cudnn.benchmark is False
    assert torch.backends.cudnn.deterministic is True
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_deterministic_after_cuda_started_without_cublas_config_is_refused(
    monkeypatch: pytest.MonkeyPatch, no_determinism: list[bool]
) -> None:
    """FAKE CUDA: too late to set CUBLAS_WORKSPACE_CONFIG once CUDA is up; say how to fix."""
    FakeCuda(2, initialized=True).install(monkeypatch)
    with pytest.raises(DeviceError, match="expected CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        dev.enable_determinism(torch.device("cuda", 0))
    assert no_determinism == []


# -- environment for ranks ------------------------------------------------------------


def test_rank_environment_for_gpus(tmp_path: Path) -> None:
    env = dev.rank_environment("auto", tmp_path, deterministic=True)
    assert env == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "flight_recorder" / "rank_"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env
    assert "CUBLAS_WORKSPACE_CONFIG" not in dev.rank_environment(
        "nccl", tmp_path, deterministic=False)


def test_rank_environment_for_forced_gloo_has_only_the_flight_recorder(tmp_path: Path) -> None:
    env = dev.rank_environment("gloo", tmp_path, deterministic=True)
    assert set(env) == {"TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"}


def test_rank_environment_does_not_touch_cuda_or_os_environ(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The agent must not poison its forks: computing the environment never asks CUDA."""
    def boom() -> bool:
        raise AssertionError("rank_environment asked CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    monkeypatch.setattr(torch.cuda, "device_count", boom)
    before = dict(os.environ)
    dev.rank_environment("auto", tmp_path, deterministic=True)
    assert dict(os.environ) == before


# -- fork safety ----------------------------------------------------------------------


def test_fork_when_cuda_is_untouched() -> None:
    assert dev.rank_start_method() == "fork"


def test_spawn_once_cuda_is_initialised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """FAKE CUDA: an agent that initialised CUDA must not fork its ranks."""
    FakeCuda(2, initialized=True).install(monkeypatch)
    assert dev.rank_start_method() == "spawn"
    assert "cannot be forked" in caplog.text


# -- honest compute timing ------------------------------------------------------------


def test_wait_for_compute_synchronizes_the_cuda_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE CUDA: before the phase flips to collective, the compute stream is drained."""
    cuda = FakeCuda(2).install(monkeypatch)
    dev.wait_for_compute(torch.device("cuda", 1))
    assert cuda.synchronized == [torch.device("cuda", 1)]


def test_wait_for_compute_is_a_no_op_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = FakeCuda(2).install(monkeypatch)
    dev.wait_for_compute(torch.device("cpu"))
    assert cuda.synchronized == []


# -- the node agent uses both ----------------------------------------------------------


class RecordingContext:
    """A multiprocessing context that records the ranks it would start (nothing runs)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.envs: list[dict[str, str]] = []

    def Process(self, target: Any, args: tuple, name: str) -> Any:  # noqa: ANN401, N802
        envs = self.envs

        class Proc:
            pid = 0
            exitcode = None

            def start(self) -> None:
                envs.append(args[0])

        return Proc()


@pytest.mark.parametrize(("initialized", "method"), [(False, "fork"), (True, "spawn")])
def test_agent_starts_ranks_with_the_device_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, initialized: bool, method: str
) -> None:
    """FAKE CUDA for the spawn case: an agent with CUDA up spawns; every rank gets FR/NCCL env."""
    import multiprocessing

    from relay_train.agent.node import NodeAgent
    from relay_train.protocol.launch import LaunchConfig

    FakeCuda(2, initialized=initialized).install(monkeypatch)
    contexts: list[RecordingContext] = []

    def get_context(name: str) -> RecordingContext:
        contexts.append(RecordingContext(name))
        return contexts[-1]

    monkeypatch.setattr(multiprocessing, "get_context", get_context)
    cfg = LaunchConfig(
        job="t", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=10,
        checkpoint_every=5, nodes=["node-a", "node-b"], ranks_per_node=2,
        master_addr="127.0.0.1", master_port=1, tracking_uri=f"sqlite:///{tmp_path / 'x.db'}",
        run_id="r", attempt_dir=str(tmp_path), attempt=1, segment=0, backend="auto",
        deterministic=True,
    )
    NodeAgent(cfg, tmp_path / "launch.json", "node-b").start_ranks()
    [context] = contexts
    assert context.method == method
    assert [e["RANK"] for e in context.envs] == ["2", "3"]
    for env in context.envs:
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
        assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "rank_")
    assert (tmp_path / "flight_recorder").is_dir()


def test_comm_hook_fences_compute_before_flipping_to_collective(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """Real 1-rank gloo group; the fence is recorded (on CPU it would be a no-op anyway).

    The order is the point: the rank must still say "compute" while it waits for
    its kernels, and "collective" only after.
    """
    from datetime import timedelta

    from relay.launchers.local.launcher import free_port
    from relay_train import api, collectives
    from relay_train.collectives import StepPhases
    from relay_train.device import RankDevice
    from relay_train.protocol.heartbeat import Phase
    from relay_train.protocol.launch import LaunchConfig

    events: list[str] = []

    class Heartbeat:
        phase_began_waited = None  # no CPU wait watched

        def enter(self, phase: Phase) -> None:
            events.append(f"enter {phase.value}")

    monkeypatch.setattr(collectives, "wait_for_compute",
                        lambda device: events.append(f"fence {device.type}"))

    class Bucket:
        def buffer(self) -> torch.Tensor:
            return torch.tensor([2.0, 4.0])

    cfg = LaunchConfig(
        job="t", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=10,
        checkpoint_every=5, nodes=["node-a"], ranks_per_node=1, master_addr="127.0.0.1",
        master_port=1, tracking_uri="sqlite:///unused.db", run_id="r",
        attempt_dir=str(tmp_path), attempt=1, segment=0, heartbeat_interval_seconds=0,
    )
    session = api.Session(cfg, rank=1, node="node-a")  # rank != 0: no MLflow publisher
    session._heartbeat = Heartbeat()  # type: ignore[assignment]
    session._phases = StepPhases(session._heartbeat)  # type: ignore[arg-type]
    session._placement = RankDevice("gloo", torch.device("cpu"), False, {})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=timedelta(seconds=30))
    try:
        hook = session.comm_hook()
        averaged = hook(None, Bucket()).wait()
        hook(None, Bucket()).wait()  # a second bucket in the same step: no second fence
    finally:
        dist.destroy_process_group()
        session._responder.close()
        session._evidence.close()
    assert events == ["fence cpu", "enter collective"]
    assert "compute_done" in session._clock
    assert averaged.tolist() == [2.0, 4.0]


def test_spawned_rank_refuses_forced_nccl_on_cpu_with_the_fix_in_its_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Real: the agent spawns (as it would once CUDA is up) a real rank; no fake CUDA.

    ``backend: nccl`` on this CPU machine must end the rank at once with exit code
    1 and the expected/found/fix message in its log, never a hang.
    """
    from relay_train.agent import node as agent
    from relay_train.protocol.launch import LaunchConfig
    from relay_train.protocol.signing import KeyRing

    monkeypatch.setattr(agent, "rank_start_method", lambda: "spawn")
    cfg = LaunchConfig(
        job="t", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=10,
        checkpoint_every=5, nodes=["node-a"], ranks_per_node=1, master_addr="127.0.0.1",
        master_port=1, tracking_uri=f"sqlite:///{tmp_path / 'x.db'}", run_id="r",
        attempt_dir=str(tmp_path),
        attempt=1, segment=0, backend="nccl",
        checkpoint_keys=KeyRing.generate().to_dict(),  # as a launcher writes it
    )
    launch = tmp_path / "launch.json"
    cfg.write(launch)
    node = agent.NodeAgent(cfg, launch, "node-a")
    node.start_ranks()
    [proc] = node.procs.values()
    proc.join(120)
    assert proc.exitcode == 1
    log = (tmp_path / "logs" / "rank-0.log").read_text()
    assert "backend: nccl: expected a CUDA build of torch with NCCL" in log
    assert "fix:" in log


def test_a_forked_rank_runs_with_the_thread_count_its_environment_sets(tmp_path: Path) -> None:
    """A rank forked from a process whose main thread kept the default intra-op thread
    count (a resident's standby: it preloaded in a thread) still gets OMP_NUM_THREADS.
    The rank is played by a fork of this test that calls the agent's ``become_rank`` with a
    ``run_rank`` that exits with the rank's thread count."""
    from relay_train import worker
    from relay_train.agent import ranks
    pid = os.fork()
    if pid == 0:  # the forked "agent" and, at once, its rank
        code = 99
        try:
            torch.set_num_threads(2)  # what a thread's preload leaves the main thread
            worker.run_rank = lambda _launch: torch.get_num_threads()  # type: ignore[assignment]
            worker.exit_now = os._exit  # type: ignore[assignment]
            ranks.become_rank({"OMP_NUM_THREADS": "1"}, tmp_path / "rank.log", tmp_path / "x")
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1, (tmp_path / "rank.log").read_text()
