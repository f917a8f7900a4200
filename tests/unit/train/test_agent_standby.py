"""A node agent's standby requests: answered by the main thread, never forked once withdrawn."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from relay_train.agent import node as agent_module
from relay_train.agent.node import NodeAgent


class _Agent(NodeAgent):
    """The request handling of NodeAgent without a launch: forks are counted, not made."""

    def __init__(self) -> None:  # noqa: D107 - only what the standby requests use
        import queue

        self.node = "node-a"
        self.stopping = False
        self._standby_asks = queue.SimpleQueue()
        self.forked: list[Path] = []

    def _fork_standby(self, ask: agent_module.StandbyAsk) -> int:
        self.forked.append(ask.directory)
        return 4242


def test_the_main_thread_forks_what_the_channel_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "STANDBY_FORK_WAIT_SECONDS", 60.0)  # busy CI cores
    agent = _Agent()
    got: list[int | None] = []
    asker = threading.Thread(target=lambda: got.append(agent.request_standby(tmp_path, 60, 0)))
    asker.start()
    while agent._standby_asks.empty():
        time.sleep(0.001)
    agent._fork_standbys()  # the main loop's turn
    asker.join()
    assert got == [4242] and agent.forked == [tmp_path]


def test_an_ask_withdrawn_after_the_wait_is_never_forked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "STANDBY_FORK_WAIT_SECONDS", 0.01)
    agent = _Agent()
    assert agent.request_standby(tmp_path, 60, 0) is None  # the main thread was busy
    agent._fork_standbys()  # ...and comes round too late: the launcher started a new one
    assert agent.forked == []


def test_a_stopping_agent_forks_nothing(tmp_path: Path) -> None:
    agent = _Agent()
    agent.stopping = True
    assert agent.request_standby(tmp_path, 60, 0) is None
    assert agent.forked == []
