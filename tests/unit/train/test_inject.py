"""Unit tests for the chaos monkey: the faults it strikes inside a rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relay_train.inject import ChaosMonkey


def test_chaos_monkey_validates_its_faults_up_front() -> None:
    with pytest.raises(ValueError, match="rnak"):
        ChaosMonkey(
            [{"kind": "crash", "step": 3, "rnak": 1}],
            segment=1,
            attempt=1,
            rank=0,
            node="n0",
        )


def run_monkey(faults: list[dict], steps: list[int]) -> subprocess.CompletedProcess[str]:
    """Run a ChaosMonkey for rank 1 on node-b through ``steps`` in a fresh interpreter."""
    code = textwrap.dedent(
        f"""
        import json
        from relay_train.inject import ChaosMonkey

        monkey = ChaosMonkey(
            json.loads({json.dumps(faults)!r}),
            segment=1, attempt=1, rank=1, node="node-b",
        )
        for step in {steps!r}:
            monkey.before_step(step)
            print("survived", step, flush=True)
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_crash_fault_sigkills_the_process_at_its_step() -> None:
    result = run_monkey([{"kind": "crash", "segment": 1, "step": 30, "rank": 1}], [28, 29, 30, 31])

    assert result.returncode == -signal.SIGKILL, result.stderr
    assert result.stdout.split("\n")[:-1] == ["survived 28", "survived 29"]


def test_non_matching_fault_does_not_kill() -> None:
    faults = [
        {"kind": "crash", "segment": 1, "step": 30, "rank": 0},  # another rank
        {"kind": "crash", "segment": 1, "step": 30, "rank": 1, "attempt": 2},  # a retry
        {"kind": "crash", "segment": 2, "step": 30},  # another segment
        {"kind": "crash", "step": 30, "node": "node-a"},  # another node
        {"kind": "crash", "step": 99},  # a step this run never reaches
    ]
    result = run_monkey(faults, [29, 30, 31])

    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["survived", "29", "survived", "30", "survived", "31"]


def _slow(faults: list[dict], root: Path, attempt: int, rank: int, node: str, step: int) -> float:
    where = root / "run" / "segment-000" / f"try-{attempt}"
    where.mkdir(parents=True, exist_ok=True)
    monkey = ChaosMonkey(faults, segment=0, attempt=attempt, rank=rank, node=node,
                         record_dir=where)
    return monkey.delay(step, 0.001)


def test_a_node_bound_straggler_stays_with_the_node_not_the_rank(tmp_path: Path) -> None:
    faults = [{"kind": "straggler", "step": 10, "rank": 3, "attempt": None, "once": True,
               "factor": 3.0}]

    assert _slow(faults, tmp_path, 1, 2, "node-b", 10) == 0.0  # nothing struck yet
    assert _slow(faults, tmp_path, 1, 3, "node-b", 9) == 0.0
    assert _slow(faults, tmp_path, 1, 3, "node-b", 10) > 0.0  # node-b turns slow
    assert _slow(faults, tmp_path, 1, 2, "node-b", 11) > 0.0  # for every rank on it
    # A later attempt resumes before step 10: node-b is still slow, whoever runs there;
    # rank 3 on another node is not.
    assert _slow(faults, tmp_path, 2, 0, "node-b", 5) > 0.0
    assert _slow(faults, tmp_path, 2, 3, "node-c", 12) == 0.0


_FROZEN_NODE = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from relay_train.protocol.env import ENV_NODE_AGENT_PID
    monkey = (
        "from relay_train.inject import ChaosMonkey;"
        "m = ChaosMonkey([{'kind': 'stop_node', 'step': 1, 'rank': 1}], segment=0, attempt=1,"
        " rank=1, node='node-b');"
        "import time; time.sleep(1.0); m.before_step(1)"
    )
    env = dict(os.environ, **{ENV_NODE_AGENT_PID: str(os.getpid())})
    # Like torchrun: each rank in a session of its own.
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    rank = subprocess.Popen([sys.executable, "-c", monkey], env=env, start_new_session=True)
    print(peer.pid, rank.pid, flush=True)
    time.sleep(60)
    """
)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_stop_node_under_torchrun_freezes_the_agent_and_every_rank() -> None:
    agent = subprocess.Popen([sys.executable, "-c", _FROZEN_NODE], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    assert agent.stdout is not None
    pids = [agent.pid, *map(int, agent.stdout.readline().split())]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_state(p) != "T" for p in pids):
            time.sleep(0.1)
        assert [_state(p) for p in pids] == ["T", "T", "T"]
    finally:
        for pid in pids:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        agent.wait()


def test_an_announced_stop_node_waits_for_its_agent_to_send_the_strike(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a node whose disk Relay cannot read, the strike is recorded with the moment the
    node will freeze, the node's agent sends it (and says so in chaos.sent), and only then,
    at that moment, does the node freeze."""
    import threading
    from types import SimpleNamespace

    import relay_train.inject as inject
    from relay_train.agent.node_status import NodeStatus
    from relay_train.protocol.injection import CHAOS_LOG

    frozen: list[float] = []
    monkeypatch.setattr(inject, "_freeze_node", lambda: frozen.append(time.time()))
    monkeypatch.setattr(inject, "ANNOUNCE_SECONDS", 1.0)
    agent = SimpleNamespace(cfg=SimpleNamespace(root=tmp_path), _chaos=(0, []))
    sent: list[list[dict[str, object]]] = []
    sent_at: list[float] = []

    def agent_polled() -> None:  # the watcher asks the agent for its status
        while not sent:
            if (tmp_path / CHAOS_LOG).exists():
                found = NodeStatus._strikes(agent)  # type: ignore[arg-type]
                if found:
                    sent.append(found)
                    sent_at.append(time.time())
            time.sleep(0.05)

    poller = threading.Thread(target=agent_polled)
    poller.start()
    monkey = ChaosMonkey([{"kind": "stop_node", "step": 5, "node": "node2"}], segment=0,
                         attempt=1, rank=2, node="node2", record_dir=tmp_path, announce=True)
    monkey.before_step(5)
    poller.join(5)
    assert sent and sent[0][0]["kind"] == "stop_node"
    assert frozen and sent_at[0] < frozen[0]  # sent before the node froze
    assert frozen[0] >= float(sent[0][0]["at"])  # the recorded onset is the freeze
