"""Who acts on a fault when execute_complete and the warden run on different machines.

The agents are real channel servers (tests/agents.py), the workload a real sleeping
process group behind a real local launcher handle, the warden a real
``python -m relay.recover.warden`` process, MLflow a real SQLite store. Simulated: the other
machine. "Elsewhere" is a claim sent to the same agents under another claimer's name,
and an attempt folder of that machine's that this one never sees.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time
from pathlib import Path

from agents import close_served_agents, serve  # noqa: F401 - the fixture closes the agents
from claims import take_as_task
from processes import wait_exit

from relay.core.attempt import Attempt
from relay.core.faults import Fault, FaultKind
from relay.launchers.local.launcher import HANDLE_FILE, LocalLauncher, agent_handle, group_members
from relay.lineage.store import Lineage
from relay.recover import claim, warden, warden_record
from relay.recover.evidence import RECEIVED_DIR
from relay.recover.save_state import STOP, from_warden
from relay.recover.warden_record import STOPPED_FILE, Stopped, folder
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig, attempt_id_of
from relay_train.protocol.stacks_files import answer_path

NODES = {"node-a": [0], "node-b": [1], "node-c": [2]}
DETECTION = {"stop_unattended_after": 1.0, "checkpoint_timeout": 5.0, "evidence_timeout": 1.0}




def _attempt(tmp_path: Path, nodes: dict[str, list[int]] = NODES,
             ) -> tuple[Path, subprocess.Popen[bytes]]:
    """An attempt: a sleeping process group, and one real agent server per node."""
    attempt = tmp_path / "dag" / "run" / "segment-000" / "try-1"
    attempt.mkdir(parents=True)
    LaunchConfig(
        job="t", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=100,
        checkpoint_every=10, nodes=list(nodes), ranks_per_node=1, master_addr="127.0.0.1",
        master_port=1, tracking_uri="file:///nowhere", run_id="r", attempt_dir=str(attempt),
        attempt=1, segment=0,
    ).write(attempt / LAUNCH_FILE)
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    served = serve(attempt, nodes)
    ports = {n: int(a.rsplit(":", 1)[1]) for n, a in served.addresses.items()}
    (attempt / HANDLE_FILE).write_text(json.dumps({
        "nodes": {n: {**agent_handle(proc.pid), "port": ports[n]} for n in nodes},
        "started_at": time.time(), "attempt_id": attempt_id_of(attempt)}))
    return attempt, proc


def test_the_first_claimer_wins_and_later_ones_are_told_who_holds_it(tmp_path: Path) -> None:
    attempt, proc = _attempt(tmp_path)
    try:
        first = claim.claim_attempt(LocalLauncher(), Attempt(attempt), "warden A")
        again = claim.claim_attempt(LocalLauncher(), Attempt(attempt), "warden A")
        second = claim.claim_attempt(LocalLauncher(), Attempt(attempt), "execute_complete B")
    finally:
        proc.kill()
    assert first.won and first.granted == sorted(NODES) and not first.held_by
    assert again.won  # asking again is harmless
    assert not second.won and second.holder == "warden A" and second.granted == []


def test_a_frozen_node_blocks_neither_a_majority_nor_a_lone_claimer(tmp_path: Path) -> None:
    attempt, proc = _attempt(tmp_path)
    try:
        serve(attempt, NODES).servers["node-c"].close()  # node-c answers nothing now
        majority = claim.claim_attempt(LocalLauncher(), Attempt(attempt), "execute_complete B")
        late = claim.claim_attempt(LocalLauncher(), Attempt(attempt), "warden A")
    finally:
        proc.kill()
    assert majority.won and majority.silent == ["node-c"]
    assert not late.won and late.holder == "execute_complete B"


def test_two_nodes_one_frozen_the_claimer_that_answers_first_takes_it(tmp_path: Path) -> None:
    attempt, proc = _attempt(tmp_path, {"node-a": [0], "node-b": [1]})
    try:
        serve(attempt, {}).servers["node-b"].close()
        first = claim.claim_attempt(LocalLauncher(), Attempt(attempt), "warden A")
        second = claim.claim_attempt(LocalLauncher(), Attempt(attempt), "execute_complete B")
    finally:
        proc.kill()
    assert first.won and first.granted == ["node-a"] and first.silent == ["node-b"]
    assert not second.won and second.holder == "warden A"


def _event(attempt: Path) -> dict[str, object]:
    fault = Fault(FaultKind.CRASH, 0, "node-a", {"summary": "rank 0 exited 1"}, time.time())
    return {**fault.to_event(), "attempt_dir": str(attempt)}


def test_a_warden_leaves_an_attempt_execute_complete_took_on_another_machine(
        tmp_path: Path) -> None:
    attempt, proc = _attempt(tmp_path)
    try:
        # execute_complete on another machine: no claimed.json here, only the agents know.
        # It claims before the warden's deadline (made first, whatever CI's load).
        assert claim.claim_attempt(LocalLauncher(), Attempt(attempt),
                                   "execute_complete elsewhere").won
        pid = warden.start_warden(attempt, _event(attempt), STOP, DETECTION, None)
        assert pid is not None
        wait_exit(pid)
        assert group_members(proc.pid) == [proc.pid], "the warden touched the workload"
        assert Stopped.read(attempt) is None
        log = (attempt / "logs" / "unattended.log").read_text()
        assert "held by execute_complete elsewhere" in log and "done: claimed" in log, log
    finally:
        proc.kill()
        proc.wait()


def test_execute_complete_waits_for_a_warden_elsewhere_and_uses_what_it_saved(
        tmp_path: Path) -> None:
    lineage = Lineage(f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "artifacts")
    run_id = lineage.attempt_run(lineage.parent_run("t", "relay_t", "run-1"), 0, 1, {})
    attempt, proc = _attempt(tmp_path / "here")
    # The warden's machine: its own copy of the attempt folder, which this one never sees.
    there = tmp_path / "there" / "try-1"
    state = there / "rescued" / "rank-1.pt"
    state.parent.mkdir(parents=True)
    state.write_bytes(b"the healthy rank's state")
    answer_path(there / RECEIVED_DIR, 0).parent.mkdir(parents=True, exist_ok=True)
    answer_path(there / RECEIVED_DIR, 0).write_text(json.dumps({"rank": 0, "threads": []}))
    stopped = Stopped(
        by="warden pid 1 on there", detected_at=1000.0, stopped_at=1031.0, step="rescue",
        survivors=[], evidence_request={"id": "x", "ranks": [0]},
        rescued={"rank": 1, "step": 30, "path": str(state), "seconds": 0.5,
                 "sha256": hashlib.sha256(state.read_bytes()).hexdigest()})
    folder(there).mkdir(parents=True)
    (folder(there) / STOPPED_FILE).write_text(json.dumps(stopped.__dict__))
    try:
        assert claim.claim_attempt(LocalLauncher(), Attempt(attempt), stopped.by).won
        looks: list[float] = []

        def fetch() -> Stopped | None:
            looks.append(time.monotonic())
            if len(looks) == 2:  # the warden logs its results once its stop is done
                warden_record.publish(lineage, run_id, there, stopped)
            return warden_record.fetch(lineage, run_id, attempt)

        got = take_as_task(attempt, 30, LocalLauncher(), fetch,
                    warden_due=time.time() - 1)  # the warden's time came
        assert got is not None and len(looks) == 2  # not there at first: it waited
        assert group_members(proc.pid) == [proc.pid], "execute_complete must not stop it first"
    finally:
        proc.kill()
        proc.wait()
    assert (got.by, got.step, got.stopped_at) == (stopped.by, "rescue", 1031.0)
    decision = type("D", (), {"checkpoint_first": False, "retry": True, "rollback": False})()
    hang = Fault(FaultKind.HANG, 2, "node-c", {})
    saved = from_warden(got, decision, hang, attempt)
    evidence, drained, rescued = saved.evidence, saved.drained_at, saved.rescued
    assert rescued is not None and Path(rescued.path).read_bytes() == state.read_bytes()
    assert Path(rescued.path).is_relative_to(attempt)  # downloaded here, sha256 checked again
    assert evidence is not None and list(evidence.answers) == [0] and drained is None


def test_execute_complete_before_the_wardens_time_claims_without_waiting(
        tmp_path: Path) -> None:
    attempt, proc = _attempt(tmp_path)
    try:
        assert take_as_task(attempt, 30, LocalLauncher(), None,
                                    warden_due=time.time() + 60) is None
        for thread in threading.enumerate():  # the warden asks 10 s+ later, not at once
            if thread.name == "relay-claim":
                thread.join(timeout=30)
        late = claim.claim_attempt(LocalLauncher(), Attempt(attempt), "warden A")
    finally:
        proc.kill()
        proc.wait()
    # The claim went out in the background; it landed before any warden could ask.
    assert not late.won and late.holder.startswith("execute_complete"), late.describe()


def test_without_a_warden_there_is_nothing_to_claim(tmp_path: Path) -> None:
    attempt, proc = _attempt(tmp_path)
    try:
        assert take_as_task(attempt, 30, LocalLauncher(), None, warden_due=None) is None
        assert claim.claim_attempt(LocalLauncher(), Attempt(attempt), "someone").won
    finally:
        proc.kill()
        proc.wait()
