"""Rescue: a healthy rank hands over its state; Relay verifies and publishes it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from agents import FrozenAgent, ServedAttempt
from torch import nn

from relay.core.attempt import Attempt
from relay.core.checkpoint_keys import checkpoint_keys
from relay.core.faults import Fault, FaultKind
from relay.lineage.store import Lineage
from relay.recover.ask_rescue import donor, kept_rescue, publish_rescue
from relay.recover.ask_rescue import request_rescue as ask_agents
from relay_train.checkpoints.checkpointer import load_verified, snapshot
from relay_train.protocol.heartbeat import Heartbeat, HeartbeatWriter
from relay_train.protocol.launch import LaunchConfig
from relay_train.protocol.rescue_files import DONE_FILE, REQUEST_FILE, RESCUE_DIR
from relay_train.rescue import RescueResponder, TrainingState


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[ServedAttempt]:
    """Real agent channel servers for node-a (ranks 0, 1) and node-b (ranks 2, 3)."""
    served = ServedAttempt(tmp_path, {"node-a": [0, 1], "node-b": [2, 3]})
    yield served
    served.close()


def _cfg(tmp_path: Path, tracking_uri: str = "sqlite:///unused.db", run_id: str = "r") -> Any:
    return LaunchConfig(
        job="t", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=100,
        checkpoint_every=10, nodes=["node-a", "node-b"], ranks_per_node=2,
        master_addr="127.0.0.1", master_port=1, tracking_uri=tracking_uri, run_id=run_id,
        attempt_dir=str(tmp_path), attempt=1, segment=0,
        checkpoint_keys=checkpoint_keys().to_dict(),  # as the segment task launches it
    )


def _beats(steps: dict[int, int], nonfinite: int | None = None) -> dict[int, Heartbeat]:
    return {r: Heartbeat(rank=r, node="node-a" if r < 2 else "node-b", pid=1, step=s,
                         nonfinite_step=nonfinite if r == 0 else None)
            for r, s in steps.items()}


@pytest.mark.parametrize(
    ("kind", "rank", "node", "steps", "expected"),
    [
        (FaultKind.HANG, 1, "node-a", {0: 40, 1: 40, 2: 40, 3: 40}, 0),
        (FaultKind.HANG, 0, "node-a", {0: 40, 1: 40, 2: 40, 3: 40}, 1),
        (FaultKind.RANK_UNRESPONSIVE, 0, "node-a", {0: 41, 1: 40, 2: 41, 3: 41}, 2),
        (FaultKind.NODE_UNRESPONSIVE, None, "node-a", {0: 40, 1: 40, 2: 40, 3: 40}, 2),
        (FaultKind.NODE_UNRESPONSIVE, None, "node-b", {0: 40, 1: 40, 2: 40, 3: 40}, 0),
        (FaultKind.NODE_UNRESPONSIVE, None, "node-b", {2: 40, 3: 40}, None),
        (FaultKind.CRASH, 1, "node-a", {0: 40, 1: 40, 2: 40, 3: 40}, None),
        (FaultKind.NAN_LOSS, 1, "node-a", {0: 40, 1: 40, 2: 40, 3: 40}, None),
        (FaultKind.STRAGGLER, 1, "node-a", {0: 40, 1: 40, 2: 40, 3: 40}, None),
    ],
)
def test_donor_is_a_healthy_rank_furthest_along(
    tmp_path: Path, kind: FaultKind, rank: int | None, node: str, steps: dict[int, int],
    expected: int | None,
) -> None:
    fault = Fault(kind, rank, node, {})
    assert donor(fault, _cfg(tmp_path), _beats(steps)) == expected


def test_a_rank_that_saw_a_nonfinite_loss_is_never_a_donor(tmp_path: Path) -> None:
    fault = Fault(FaultKind.HANG, 3, "node-b", {})
    assert donor(fault, _cfg(tmp_path), _beats({0: 40, 3: 40}, nonfinite=12)) is None


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _responder(root: Path, rank: int, state: TrainingState) -> tuple[RescueResponder, nn.Module]:
    model, optimizer = _model()
    responder = RescueResponder(
        root, rank, state, lambda step: snapshot(model, optimizer, step, {}), poll_seconds=0.02
    )
    return responder, model


def _request(root: Path, rank: int) -> None:
    (root / RESCUE_DIR).mkdir(exist_ok=True)
    (root / RESCUE_DIR / REQUEST_FILE).write_text(json.dumps({"rank": rank}))


def _wait(path: Path, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_responder_snapshots_the_state_after_the_completed_steps(tmp_path: Path) -> None:
    state = TrainingState(completed=17)
    responder, model = _responder(tmp_path, 2, state)
    responder.start()
    _request(tmp_path, 2)
    _wait(tmp_path / RESCUE_DIR / DONE_FILE)
    done = json.loads((tmp_path / RESCUE_DIR / DONE_FILE).read_text())
    assert (done["rank"], done["step"], done["refused"]) == (2, 17, None)
    loaded = load_verified(Path(done["path"]), done["sha256"])
    assert loaded["step"] == 17
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())


def test_responder_ignores_requests_for_other_ranks(tmp_path: Path) -> None:
    responder, _ = _responder(tmp_path, 0, TrainingState(completed=5))
    responder.start()
    _request(tmp_path, 1)
    time.sleep(0.3)
    responder.close()
    assert not (tmp_path / RESCUE_DIR / DONE_FILE).exists()


def test_responder_waits_for_the_optimizer_step_to_finish(tmp_path: Path) -> None:
    state = TrainingState(completed=9)
    responder, _ = _responder(tmp_path, 0, state)
    responder.start()
    with state.lock:  # the loop is inside optimizer.step()
        _request(tmp_path, 0)
        time.sleep(0.3)
        assert not (tmp_path / RESCUE_DIR / DONE_FILE).exists()
        state.completed = 10
    _wait(tmp_path / RESCUE_DIR / DONE_FILE)
    assert json.loads((tmp_path / RESCUE_DIR / DONE_FILE).read_text())["step"] == 10


def test_responder_refuses_poisoned_weights(tmp_path: Path) -> None:
    state = TrainingState(completed=9)
    state.finite = False
    responder, _ = _responder(tmp_path, 0, state)
    responder.start()
    _request(tmp_path, 0)
    _wait(tmp_path / RESCUE_DIR / DONE_FILE)
    done = json.loads((tmp_path / RESCUE_DIR / DONE_FILE).read_text())
    assert done["refused"] and done["path"] is None


def _live_beats(root: Path, ranks: list[int]) -> None:
    for rank in ranks:
        writer = HeartbeatWriter(root / "heartbeats", rank, "node-a" if rank < 2 else "node-b",
                                 1.0, step=30)
        writer.beat(step=30)
        writer.flush_now()


def test_request_rescue_returns_the_verified_state(tmp_path: Path, agents: ServedAttempt) -> None:
    _live_beats(tmp_path, [0, 2, 3])
    state = TrainingState(completed=30)
    responder, _ = _responder(tmp_path, 0, state)
    responder.start()
    fault = Fault(FaultKind.NODE_UNRESPONSIVE, None, "node-b", {})
    result = ask_agents(Attempt(tmp_path), _cfg(tmp_path), fault, 20, agents)
    assert result is not None and (result.rank, result.step) == (0, 30)


def test_a_frozen_nodes_agent_is_not_asked(tmp_path: Path) -> None:
    """node-b's agent is frozen (a socket that takes connections and never answers, as a
    SIGSTOPped agent's does): polling it would cost a timeout before the stop."""
    frozen = FrozenAgent()
    served = ServedAttempt(tmp_path, {"node-a": [0, 1]})
    served.addresses["node-b"] = frozen.address
    _live_beats(tmp_path, [0, 1])
    responder, _ = _responder(tmp_path, 0, TrainingState(completed=30))
    responder.start()
    try:
        fault = Fault(FaultKind.NODE_UNRESPONSIVE, None, "node-b", {})
        result = ask_agents(Attempt(tmp_path), _cfg(tmp_path), fault, 20, served)
        assert not frozen.was_asked()
    finally:
        responder.close()
        served.close()
        frozen.close()
    assert result is not None and (result.rank, result.step) == (0, 30)


def test_a_retry_finishing_the_record_reuses_the_state_fetched_before_the_stop(
    tmp_path: Path, agents: ServedAttempt
) -> None:
    # A task killed after the stop leaves no rank to ask: its retry finds what was fetched.
    _live_beats(tmp_path, [0, 2, 3])
    responder, _ = _responder(tmp_path, 0, TrainingState(completed=30))
    responder.start()
    fault = Fault(FaultKind.NODE_UNRESPONSIVE, None, "node-b", {})
    first = ask_agents(Attempt(tmp_path), _cfg(tmp_path), fault, 20, agents)
    assert first is not None

    class NoOneThere:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"asked the launcher for {name}: the workload is gone")

    again = ask_agents(Attempt(tmp_path), _cfg(tmp_path), fault, 20, NoOneThere())  # type: ignore[arg-type]
    assert again == first
    Path(str(first.path)).write_bytes(b"damaged on Relay's disk")
    assert kept_rescue(tmp_path) is None  # never reused unless it still matches its sha256


def test_request_rescue_gives_up_when_nobody_answers(tmp_path: Path, agents: ServedAttempt) -> None:
    _live_beats(tmp_path, [0, 1])
    fault = Fault(FaultKind.HANG, 1, "node-a", {})
    started = time.monotonic()
    assert ask_agents(Attempt(tmp_path), _cfg(tmp_path), fault, 20, agents) is None
    assert time.monotonic() - started < 15  # the ack timeout, not the save timeout


def test_request_rescue_rejects_a_file_that_does_not_match_its_sha256(
    tmp_path: Path, agents: ServedAttempt
) -> None:
    _live_beats(tmp_path, [0, 1])
    state = TrainingState(completed=30)
    responder, _ = _responder(tmp_path, 0, state)
    original = responder.respond

    def tampered() -> Any:
        result = original()
        Path(result.path).write_bytes(b"not the checkpoint")
        return result

    responder.respond = tampered  # type: ignore[method-assign]
    responder.start()
    fault = Fault(FaultKind.HANG, 1, "node-a", {})
    assert ask_agents(Attempt(tmp_path), _cfg(tmp_path), fault, 20, agents) is None


def test_published_rescue_is_the_next_resume_point(
    tmp_path: Path, agents: ServedAttempt
) -> None:
    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    parent = lineage.parent_run("t", "relay_t", "run-1")
    run_id = lineage.attempt_run(parent, 0, 1, {"segment": 0})
    _live_beats(tmp_path, [0, 1])
    responder, model = _responder(tmp_path, 0, TrainingState(completed=30))
    responder.start()
    fault = Fault(FaultKind.HANG, 1, "node-a", {})
    cfg = _cfg(tmp_path, lineage.tracking_uri, run_id)
    result = ask_agents(Attempt(tmp_path), cfg, fault, 20, agents)
    assert result is not None
    manifest = publish_rescue(result, cfg, fault, parent=None)
    assert manifest.origin == "rescued from rank 0 after hang"
    latest, corrupt = lineage.resume_point(parent, tmp_path / "download")
    assert corrupt == [] and latest is not None
    assert (latest.manifest.step, latest.manifest.origin) == (30, manifest.origin)
    loaded = load_verified(latest.path, latest.manifest.sha256)
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())


def test_responder_thread_is_a_daemon(tmp_path: Path) -> None:
    responder, _ = _responder(tmp_path, 0, TrainingState(completed=1))
    responder.start()
    assert any(t.name == "rescue" and t.daemon for t in threading.enumerate())
    responder.close()
