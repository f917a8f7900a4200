"""Hang evidence: ranks answer with their stacks and Flight Recorder trace; Relay collects, bounded.

Real threads and real processes: a rank stuck in Python, a SIGSTOPped rank, a
rank whose main thread holds the GIL in C (faulthandler's turn), and a real
2-process gloo group whose Flight Recorder shows the collective a rank waits in.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agents import FrozenAgent, close_served_agents, serve  # noqa: F401 - the fixture closes them

from relay.core.attempt import Attempt
from relay.core.faults import Fault, FaultKind
from relay.lineage.store import Lineage
from relay.recover.evidence import (
    EvidenceRequest,
    attach_evidence,
    collect_evidence,
    evidence_summary,
)
from relay.recover.evidence import ask_for_evidence as ask_agents
from relay_train.agent.node_files import signal_faulthandler
from relay_train.checkpoints.publish import mlflow_retrying
from relay_train.protocol.launch import LaunchConfig
from relay_train.protocol.stacks_files import EVIDENCE_DIR, FR_DIR, answer_path, armed_path
from relay_train.stacks import EvidenceResponder, flight_recorder_environment

REPO = Path(__file__).resolve().parents[3]

def layout(world_size: int) -> LaunchConfig:
    """Return a launch of ``world_size`` ranks, one per node: node-a, node-b."""
    return LaunchConfig(job="t", seed=0, model={}, data={}, optimizer={}, start_step=0,
                        end_step=1, checkpoint_every=1, nodes=["node-a", "node-b"][:world_size],
                        ranks_per_node=1, master_addr="127.0.0.1", master_port=1,
                        tracking_uri="", run_id="", attempt_dir="", attempt=1, segment=0)


def ask_for_evidence(root: Path, fault: Fault, world_size: int) -> EvidenceRequest | None:
    """Ask through real agent channel servers for node-a (rank 0) and node-b (rank 1)."""
    return ask_agents(Attempt(root), fault, layout(world_size),
                      serve(root, {"node-a": [0], "node-b": [1]}))
# Generous: the machine is shared; a bound only matters for ranks that never answer.
ANSWER_TIMEOUT = 20.0


def stuck_in_a_python_loop(release: threading.Event) -> None:
    """Stand in for a hung rank's training code."""
    while not release.wait(0.01):
        pass


@pytest.fixture
def stuck_thread() -> Iterator[threading.Thread]:
    release = threading.Event()
    thread = threading.Thread(target=stuck_in_a_python_loop, args=(release,), name="stuck")
    thread.start()
    yield thread
    release.set()
    thread.join()


def _hang(rank: int) -> Fault:
    return Fault(FaultKind.HANG, rank, "node-a", {"summary": "stuck"})


def test_a_rank_answers_with_every_threads_stack(tmp_path: Path, stuck_thread: object) -> None:
    responder = EvidenceResponder(tmp_path, 0, "node-a", poll_seconds=0.02)
    responder.start()
    try:
        request = ask_for_evidence(tmp_path, _hang(0), world_size=1)
        assert request is not None
        evidence = collect_evidence(request, ANSWER_TIMEOUT)
    finally:
        responder.close()
    assert evidence.missing == [] and list(evidence.answers) == [0]
    threads = {t["thread"]: t for t in evidence.answers[0]["threads"]}
    assert threads["MainThread"]["main"] and not threads["stuck"]["main"]
    assert "stuck_in_a_python_loop" in [f["function"] for f in threads["stuck"]["frames"]]
    assert "evidence" not in threads  # the answering thread leaves itself out
    summary = evidence_summary(evidence, culprit=0)
    culprit = summary["stacks"][0]
    assert culprit["rank"] == 0 and culprit["culprit"]
    assert any("stuck_in_a_python_loop" in line for line in culprit["threads"]["stuck"])


def test_only_hang_like_faults_ask_for_evidence(tmp_path: Path) -> None:
    crash = Fault(FaultKind.CRASH, 1, "node-a", {})
    assert ask_for_evidence(tmp_path, crash, world_size=2) is None
    assert not (tmp_path / EVIDENCE_DIR).exists()


def test_a_new_request_gets_a_new_answer(tmp_path: Path) -> None:
    responder = EvidenceResponder(tmp_path, 0, "node-a", poll_seconds=0.02)
    responder.start()
    try:
        first = collect_evidence(ask_for_evidence(tmp_path, _hang(0), 1), ANSWER_TIMEOUT)
        second = collect_evidence(ask_for_evidence(tmp_path, _hang(0), 1), ANSWER_TIMEOUT)
    finally:
        responder.close()
    assert first.answers[0]["request"] != second.answers[0]["request"]


RANK_SCRIPT = """
import re, sys, time
from pathlib import Path
from relay_train.stacks import EvidenceResponder

PATTERN = re.compile(r"(a+)+$")  # compiled before "ready": from then on the thread is in C

def stuck_in_c_holding_the_gil():
    PATTERN.match("a" * 64 + "b")  # catastrophic backtracking: never lets go of the GIL

responder = EvidenceResponder(Path(sys.argv[1]), int(sys.argv[2]), "node-b", poll_seconds=0.02)
responder.start()
Path(sys.argv[1], "ready").write_text("ready")
if sys.argv[3] == "c":
    stuck_in_c_holding_the_gil()
while True:
    time.sleep(1)
"""


def _start_rank(tmp_path: Path, rank: int, mode: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}/plugins:{REPO}"}
    proc = subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(tmp_path), str(rank), mode],
                            env=env)
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "rank did not start"
        time.sleep(0.05)
    return proc


def test_a_stopped_rank_is_skipped_within_the_bound(tmp_path: Path) -> None:
    proc = _start_rank(tmp_path, 1, "sleep")
    responder = EvidenceResponder(tmp_path, 0, "node-a", poll_seconds=0.02)
    responder.start()
    os.kill(proc.pid, signal.SIGSTOP)
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.01)  # the signal is delivered when the process next runs: wait for it
    try:
        request = ask_for_evidence(tmp_path, Fault(FaultKind.RANK_UNRESPONSIVE, 1, "node-b", {}),
                                   world_size=2)
        evidence = collect_evidence(request, timeout_seconds=3.0)  # rank 0 answers meanwhile
    finally:
        responder.close()
        proc.kill()
        proc.wait()
    assert list(evidence.answers) == [0] and evidence.missing == [1]
    assert not answer_path(tmp_path / EVIDENCE_DIR, 1).exists()
    summary = evidence_summary(evidence, culprit=1)
    assert summary["stacks_missing_ranks"] == [1]
    assert summary["where"].startswith("rank 1 did not answer")
    assert [s["rank"] for s in summary["stacks"]] == [0]


def test_a_frozen_nodes_agent_is_not_asked_and_its_ranks_not_waited_for(tmp_path: Path) -> None:
    """node-b's agent is frozen (a socket that takes connections and never answers, as a
    SIGSTOPped agent's does): asking it would cost a request timeout before the stop."""
    frozen = FrozenAgent()
    served = serve(tmp_path, {"node-a": [0]})
    served.addresses["node-b"] = frozen.address
    responder = EvidenceResponder(tmp_path, 0, "node-a", poll_seconds=0.02)
    responder.start()
    try:
        fault = Fault(FaultKind.NODE_UNRESPONSIVE, None, "node-b", {"summary": "silent"})
        request = ask_agents(Attempt(tmp_path), fault, layout(2), served)
        assert request is not None and request.nodes == ["node-a"]
        evidence = collect_evidence(request, ANSWER_TIMEOUT)
        assert not frozen.was_asked()
    finally:
        responder.close()
        frozen.close()
    assert list(evidence.answers) == [0] and evidence.missing == [1]
    # Rank 0 answered, rank 1 is not awaited: done long before the bound.
    assert evidence.seconds < ANSWER_TIMEOUT


def test_a_main_thread_stuck_in_c_is_dumped_by_faulthandler(tmp_path: Path) -> None:
    proc = _start_rank(tmp_path, 0, "c")
    try:
        armed = json.loads(armed_path(tmp_path / EVIDENCE_DIR, 0).read_text())
        assert armed["pid"] == proc.pid and armed["host"] == socket.gethostname()
        request = ask_for_evidence(tmp_path, _hang(0), world_size=1)
        evidence = collect_evidence(request, timeout_seconds=8.0)  # the dump is asked at 4 s
    finally:
        proc.kill()
        proc.wait()
    assert evidence.answers == {} and evidence.missing == []
    assert "stuck_in_c_holding_the_gil" in evidence.fallback_stacks[0]
    summary = evidence_summary(evidence, culprit=0)
    assert summary["stacks"][0]["culprit"]
    dumped = summary["stacks"][0]["faulthandler"]
    assert any("stuck_in_c_holding_the_gil" in line for line in dumped)


GLOO_SCRIPT = """
import os, sys, time
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
from relay_train.stacks import EvidenceResponder

def rank_one_never_joins():
    while True:
        time.sleep(3600)

folder, rank, port = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=120))
EvidenceResponder(folder, rank, f"node-{rank}", poll_seconds=0.02).start()
for _ in range(3):
    dist.all_reduce(torch.ones(4))
Path(folder, f"ready-{rank}").write_text("ready")
if rank == 1:
    rank_one_never_joins()
dist.all_reduce(torch.ones(8))
"""


def test_flight_recorder_shows_the_collective_a_rank_waits_in(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **flight_recorder_environment(), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}/plugins:{REPO}"}
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_SCRIPT, str(tmp_path), str(r),
                               str(port)], env=env) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.2)  # rank 0 enters its fourth all-reduce
        request = ask_for_evidence(tmp_path, _hang(1), world_size=2)
        evidence = collect_evidence(request, ANSWER_TIMEOUT)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert evidence.missing == [] and sorted(evidence.traces) == [0, 1]
    summary = evidence_summary(evidence, culprit=1)
    assert summary["where"].startswith("rank 1 in rank_one_never_joins")
    assert "rank 0 waits in gloo:all_reduce" in summary["where"]
    last = next(iter(summary["collectives"]["0"].values()))
    assert last[-1]["op"] == "gloo:all_reduce" and not last[-1]["finished"]
    assert last[-1]["sizes"] == [[8]] and all(e["finished"] for e in last[:-1])
    assert [e["seq"] for e in last] == sorted(e["seq"] for e in last)
    assert all(e["finished"] for e in next(iter(summary["collectives"]["1"].values())))
    # torch's own analyzer reads the pickled dumps and names the rank that never joined.
    analyzer = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
         str(tmp_path / EVIDENCE_DIR / FR_DIR)], capture_output=True, text=True, timeout=300)
    assert analyzer.returncode == 0, analyzer.stderr[-3000:]
    assert "missing ranks: {1}" in analyzer.stdout + analyzer.stderr


def test_a_pid_that_may_have_been_reused_is_never_signalled(tmp_path: Path) -> None:
    folder = tmp_path / EVIDENCE_DIR
    folder.mkdir()
    armed = {"pid": os.getpid(), "host": socket.gethostname(), "signal": int(signal.SIGUSR2)}
    for started in (0, None):  # another process's start time, or none known
        armed_path(folder, 0).write_text(json.dumps({**armed, "started": started}))
        assert not signal_faulthandler(folder, 0)  # SIGUSR2's default action would end us


def test_an_mlflow_failure_never_loses_the_fault_record(tmp_path: Path) -> None:
    responder = EvidenceResponder(tmp_path, 0, "node-a", poll_seconds=0.02)
    responder.start()
    try:
        evidence = collect_evidence(ask_for_evidence(tmp_path, _hang(0), 1), ANSWER_TIMEOUT)
    finally:
        responder.close()
    (tmp_path / "not-a-folder").write_text("")  # the store's folder cannot be created
    lineage = Lineage(f"sqlite:///{tmp_path}/not-a-folder/mlflow.db", tmp_path / "artifacts",
                      retrying=mlflow_retrying(attempts=1))
    record = _hang(0).to_event()["fault"]
    attach_evidence(record, evidence, lineage, "run-id")
    assert record["evidence"]["summary"] == "stuck"
    assert record["evidence"]["stacks"][0]["rank"] == 0
    assert answer_path(tmp_path / EVIDENCE_DIR, 0).exists()  # the files stay for the on-call


def test_a_rank_that_has_exited_is_not_waited_for(tmp_path: Path) -> None:
    proc = _start_rank(tmp_path, 0, "sleep")
    proc.kill()
    proc.wait()
    request = ask_for_evidence(tmp_path, _hang(0), world_size=1)
    evidence = collect_evidence(request, timeout_seconds=120)
    assert evidence.answers == {} and evidence.missing == [0]
    assert evidence.seconds < 120, "a rank that is gone must not be waited for"
