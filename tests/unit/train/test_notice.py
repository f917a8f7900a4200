"""A node agent takes a SIGTERM Relay did not ask for as a preemption notice."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from relay_train.agent import notice as notice_module
from relay_train.agent.node import NodeAgent
from relay_train.agent.notice import STOP_MARGIN_SECONDS, Notice, grace_from_env
from relay_train.protocol.env import ENV_PREEMPT_GRACE
from relay_train.protocol.launch import STOP_FILE, LaunchConfig
from relay_train.protocol.routes import (
    AGE_SECONDS,
    DEFAULT_PREEMPT_GRACE_SECONDS,
    DRAIN_SECONDS,
    GRACE_SECONDS,
    PREEMPTED,
)


def _agent(tmp_path: Path) -> NodeAgent:
    cfg = LaunchConfig(
        job="t", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=10,
        checkpoint_every=5, nodes=["node-a"], ranks_per_node=1, master_addr="127.0.0.1",
        master_port=1, tracking_uri=f"sqlite:///{tmp_path / 'x.db'}", run_id="r",
        attempt_dir=str(tmp_path), attempt=1, segment=0, backend="gloo",
    )
    return NodeAgent(cfg, tmp_path / "launch.json", "node-a")


@pytest.mark.parametrize(("raw", "grace"), [
    (None, DEFAULT_PREEMPT_GRACE_SECONDS), ("", DEFAULT_PREEMPT_GRACE_SECONDS), ("90", 90.0),
    ("0", 0.0), ("soon", DEFAULT_PREEMPT_GRACE_SECONDS), ("-5", DEFAULT_PREEMPT_GRACE_SECONDS),
    ("nan", DEFAULT_PREEMPT_GRACE_SECONDS),
])
def test_the_grace_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str | None,
                                              grace: float) -> None:
    if raw is None:
        monkeypatch.delenv(ENV_PREEMPT_GRACE, raising=False)
    else:
        monkeypatch.setenv(ENV_PREEMPT_GRACE, raw)
    assert grace_from_env() == grace


def test_a_sigterm_while_running_is_a_notice_reported_on_the_channel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_PREEMPT_GRACE, "40")
    agent = _agent(tmp_path)
    assert PREEMPTED not in agent.status_record()
    agent._on_term(signal.SIGTERM, None)
    assert agent.stopping is False  # the ranks train on, for Relay to drain them
    reported = agent.status_record()[PREEMPTED]
    assert reported[GRACE_SECONDS] == 40.0
    assert reported[DRAIN_SECONDS] == 40.0 - STOP_MARGIN_SECONDS
    assert 0.0 <= reported[AGE_SECONDS] < 40.0
    first = agent.notice
    agent._on_term(signal.SIGTERM, None)  # a repeated notice changes nothing
    assert agent.notice is first


def test_a_sigterm_after_relays_stop_is_no_notice(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    agent.request_stop("Relay asked over the channel")
    agent._on_term(signal.SIGTERM, None)
    assert agent.notice is None and PREEMPTED not in agent.status_record()


def test_a_sigterm_relay_marked_as_its_stop_is_no_notice(tmp_path: Path) -> None:
    # Relay's channel request came late or never (a frozen or loaded agent), but the local
    # launcher marked its stop in the attempt folder before signalling.
    agent = _agent(tmp_path)
    (tmp_path / STOP_FILE).write_text("{}")
    agent._on_term(signal.SIGTERM, None)
    assert agent.notice is None and agent.stopping is True
    assert PREEMPTED not in agent.status_record()


def test_a_stop_asked_after_a_notice_stops_the_ranks_at_once(tmp_path: Path) -> None:
    # The SIGTERM outran Relay's (slow) channel request: the request, when it comes, stops
    # the ranks now instead of at the end of the drain window.
    agent = _agent(tmp_path)
    agent._on_term(signal.SIGTERM, None)
    assert agent.notice is not None and agent.stopping is False
    agent.request_stop("Relay asked over the channel")
    assert agent.stopping is True


def test_the_agent_stops_its_ranks_itself_in_time_for_the_platforms_kill(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(notice_module.time, "monotonic", lambda: clock[0])
    notice = Notice(30.0, received=clock[0])
    assert not notice.due()
    clock[0] += 30.0 - STOP_MARGIN_SECONDS
    assert notice.due() and not notice.expired()
    clock[0] += STOP_MARGIN_SECONDS
    assert notice.expired()
    assert Notice(2.0).drain_seconds == 0.0  # a grace shorter than the margin: stop at once
