"""The local launcher's listening ports: below the kernel's ephemeral range, fresh per launch."""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relay.launchers.local import launcher as local_launcher
from relay.launchers.local import ports
from relay.launchers.local.launcher import LocalLauncher
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig

RANGE = (32768, 60999)  # Linux's default ephemeral range


@pytest.fixture
def ephemeral(monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: RANGE)
    return RANGE


def test_listen_ports_stay_below_the_ephemeral_range(ephemeral: tuple[int, int]) -> None:
    picked = ports.listen_ports(200)
    assert len(set(picked)) == 200
    assert all(ports.LISTEN_PORTS_FROM <= p < ephemeral[0] for p in picked), picked
    assert ports.LISTEN_PORTS_FROM <= ports.listen_port() < ephemeral[0]


def test_a_port_someone_holds_is_not_picked(
        ephemeral: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        fallback = next(p for p in range(ports.LISTEN_PORTS_FROM, ephemeral[0])
                        if p != busy and ports.bindable(p))
        picks = iter([busy, busy, fallback])
        monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(picks))
        assert not ports.bindable(busy)
        assert ports.listen_port() == fallback


@pytest.mark.parametrize("found", [None, (1024, 65535)], ids=["unreadable", "no-room-below"])
def test_without_room_below_the_range_ports_come_from_the_kernel(
        found: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: found)
    kernel = iter([40001, 40001, 40002])  # the kernel may hand out a port twice
    monkeypatch.setattr(ports, "free_port", lambda: next(kernel))
    assert ports.listen_ports(2) == [40001, 40002]


@pytest.mark.parametrize(("text", "expected"), [
    ("32768\t60999\n", (32768, 60999)),
    ("40000 50000", (40000, 50000)),
    ("60999\t32768\n", None),  # not a range
    ("garbage", None),
])
def test_the_range_file_is_read(text: str, expected: tuple[int, int] | None,
                                tmp_path: Path) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    assert ports.ephemeral_range(path) == expected
    assert ports.ephemeral_range(tmp_path / "missing") is None


class FakeAgent:
    """Stands in for an agent's process: launch() only needs its PID."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        self.pid = os.getpid()


@pytest.fixture
def counted_ports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    counter = itertools.count(21000)
    monkeypatch.setattr(local_launcher, "listen_ports",
                        lambda n: [next(counter) for _ in range(n)])
    monkeypatch.setattr(local_launcher.subprocess, "Popen", FakeAgent)
    yield


def test_every_launch_of_a_retry_gets_fresh_ports(counted_ports: None, tmp_path: Path) -> None:
    # The segment task builds each try's LaunchConfig afresh (master_port 0): the
    # launcher picks the rendezvous port per launch, so a retry never inherits a taken one.
    seen = []
    for attempt in (1, 2):
        root = tmp_path / "run" / "segment-000" / f"try-{attempt}"
        cfg = LaunchConfig(
            job="t", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=10,
            checkpoint_every=5, nodes=["node-a", "node-b"], ranks_per_node=1,
            tracking_uri="file:///nowhere", run_id="r", attempt_dir=str(root),
            attempt=attempt, segment=0)
        LocalLauncher().launch(cfg)
        written = LaunchConfig.read(root / LAUNCH_FILE)
        seen.append((written.agent_ports, written.master_port))
    assert seen == [({"node-a": 21000, "node-b": 21001}, 21002),
                    ({"node-a": 21003, "node-b": 21004}, 21005)]
