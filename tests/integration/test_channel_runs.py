"""The channel on real workloads: skewed node clocks, no attempt-folder reads, fencing.

Real node agents and 2-4 gloo ranks per attempt (local launcher), the real
watcher; the fencing test also runs a real ``mlflow server``. The one thing
simulated is what this machine cannot do: a network partition (the test hook
``RELAY_TEST_PARTITIONED_NODES`` keeps the stop from reaching a node) and the
stale address a cluster's DNS could hand out (the retry's channel is pointed
at the old agent, as a reused pod IP would).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relay.core.attempt import Attempt
from relay.core.checkpoint_keys import checkpoint_keys
from relay.core.faults import Fault
from relay.launchers.local.launcher import ENV_PARTITIONED, LocalLauncher
from relay.lineage.store import TAG_REJECTED, Lineage
from relay.policy.model import Detection
from relay.recover.ask_rescue import RECEIVED_DIR as RESCUED
from relay.recover.ask_rescue import request_rescue
from relay.recover.evidence import ask_for_evidence, collect_evidence
from relay.tools.bench.common import TINY_MODEL, Store, launch_config, launched, node_ranks, watch
from relay.tools.mlflow_server import mlflow_server as running_mlflow_server
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay.watch.triggers import observe_attempt
from relay_train.protocol.env import ENV_CLOCK_SKEW
from relay_train.protocol.heartbeat import read_heartbeats
from relay_train.protocol.launch import LaunchConfig, attempt_id_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return Store(tmp_path_factory.mktemp("mlflow"))


def test_node_clocks_skewed_30s_either_way_raise_no_false_alarm(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # node-a's agent and ranks run 30 s ahead of Relay, node-b's 30 s behind.
    monkeypatch.setenv(ENV_CLOCK_SKEW, "node-a=30,node-b=-30")
    cfg = launch_config(store, tmp_path / "attempt", steps=150)
    # Every rule that reads a time is on (hang, rank and node unresponsive, launch failure);
    # the compute-time ratios (straggler, throughput) read no clock, and on this loaded
    # 2-core machine they trip on their own: they are out of this test's way.
    detection = Detection(straggler={"ratio": 50}, throughput={"floor": 0.01})
    with launched(cfg) as attempt:
        root = attempt.folder
        event = watch(cfg, detection, timeout=300)
        on_disk = read_heartbeats(root / "heartbeats")  # the test looks; Relay did not
    assert event["status"] == "completed", event
    now = time.time()
    skews = {r: b.wall_clock - now for r, b in on_disk.items()}
    assert all(15 < skews[r] < 31 for r in (0, 1)), skews  # the hook really moved the clocks
    assert all(-50 < skews[r] < -29 for r in (2, 3)), skews


class FileAudit:
    """Record what this process reads or lists under a folder (sys.addaudithook)."""

    def __init__(self, folder: Path) -> None:
        self.folder = str(folder)
        self.reads: set[str] = set()
        self.listed: set[str] = set()
        self.on = False
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:  # type: ignore[type-arg]
        if not self.on or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.fsdecode(args[0])
        if not path.startswith(self.folder):
            return
        if event == "open":
            mode, flags = args[1], args[2]
            writing = ("w" in mode or "a" in mode or "x" in mode) if isinstance(mode, str) \
                else bool(flags & (os.O_WRONLY | os.O_RDWR))
            if not writing:
                self.reads.add(os.path.relpath(path, self.folder))
        elif event in ("os.listdir", "os.scandir", "glob.glob"):
            self.listed.add(os.path.relpath(path, self.folder))


def test_the_watcher_evidence_and_rescue_read_no_file_of_the_attempt(
    store: Store, tmp_path: Path
) -> None:
    cfg = launch_config(store, tmp_path / "attempt", steps=100_000,
                        chaos=[{"kind": "hang", "step": 30, "rank": 1}])
    audit = FileAudit(cfg.root)
    launcher = LocalLauncher()
    with launched(cfg) as attempt:
        root = attempt.folder
        audit.on = True
        # Only the hang is under test: a loaded machine's slow rank is not this test's business.
        event = watch(cfg, Detection(straggler={"ratio": 50}), timeout=180)
        assert event["status"] == "faulted" and event["fault"]["kind"] == "hang", event
        fault = Fault.from_event(event["fault"])
        asked = ask_for_evidence(attempt, fault, cfg, launcher)
        rescued = request_rescue(attempt, cfg, fault, 60, launcher)
        evidence = collect_evidence(asked, 5.0) if asked else None
        audit.on = False
    assert rescued is not None and rescued.step is not None and rescued.step >= 29
    assert Path(rescued.path).is_relative_to(root / RESCUED)  # fetched over the channel
    assert evidence is not None and 0 in evidence.answers and evidence.traces
    # Reads under the attempt folder: the local launcher's own launch record and the launch
    # file it wrote (the channel secret, 0600), and what Relay itself wrote from the
    # channel's answers (the rescued file, to hash it).
    relay_side = {"handle.json", "launch.json"}
    assert {r for r in audit.reads if not r.startswith(RESCUED)} <= relay_side, audit.reads
    assert not audit.listed, audit.listed


def test_a_watcher_at_a_segment_boundary_reads_no_file_of_the_attempt(
    store: Store, tmp_path: Path
) -> None:
    # segment_boundary: adopt. The workload trains on past its segment's end (step 40), and
    # its watcher completes once every rank is past it or rank 0 recorded crossing it: that
    # record comes over the channel, from the agent of rank 0's node.
    cfg = dataclasses.replace(launch_config(store, tmp_path / "attempt", steps=40),
                              boundaries=[40, 100_000], run_on_to=100_000)
    audit = FileAudit(cfg.root)
    launcher = LocalLauncher()
    with launched(cfg) as attempt:
        audit.on = True
        event = watch(cfg, Detection(straggler={"ratio": 50}), timeout=180, boundary_step=40)
        crossed = _wait("rank 0's crossing, over the channel",
                        lambda: launcher.status(attempt).crossed, timeout=60)
        audit.on = False
    assert event["status"] == "completed" and event["boundary_step"] == 40, event
    assert crossed == {40}
    # The local launcher's launch record, and the launch file it wrote (the channel secret).
    assert audit.reads <= {"handle.json", "launch.json"}, audit.reads
    assert not audit.listed, audit.listed


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server: a frozen rank then holds no lock Relay needs."""
    with running_mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as url:
        yield url


def _attempt(lineage: Lineage, parent: str, base: Path, attempt: int, node: str,
             end_step: int) -> LaunchConfig:
    root = base / "relay_fence" / "run-1" / "segment-000" / f"try-{attempt}"
    run_id = lineage.attempt_run(parent, 0, attempt, {"segment": 0, "attempt": attempt})
    return LaunchConfig(
        job="fence", seed=1, model=TINY_MODEL, data={"corpus": "builtin:python_docs",
        "batch_size": 8}, optimizer={"lr": 0.003}, start_step=0, end_step=end_step,
        checkpoint_every=25, nodes=[node], ranks_per_node=2, master_addr="127.0.0.1",
        tracking_uri=lineage.tracking_uri, run_id=run_id,
        attempt_dir=str(root), attempt=attempt, segment=0,
        checkpoint_keys=checkpoint_keys().to_dict())  # as the segment task launches it


def _wait(what: str, check: object, timeout: float = 240.0) -> object:
    deadline = time.monotonic() + timeout
    while not (found := check()):  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return found


def test_a_frozen_node_resumed_after_its_attempt_was_replaced_is_refused(
    mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lineage = Lineage(mlflow_server, tmp_path / "unused")
    parent = lineage.parent_run("fence", "relay_fence", "run-1")
    old = _attempt(lineage, parent, tmp_path, 1, "node-a", end_step=100_000)
    # The node must freeze once the watcher has seen its ranks step: frozen before that,
    # it is called at startup_timeout as a launch that never got going (Detector._first_step).
    # A checkpoint in MLflow is no proof (25 fast steps can pass between two polls).
    stepping, check = threading.Event(), Detector.check

    def watching(detector: Detector, obs: Observation) -> Fault | None:
        beats = obs.heartbeats.values()
        if len(beats) == 2 and all(b.step > 0 and b.phase != "starting" for b in beats):
            stepping.set()
        return check(detector, obs)

    monkeypatch.setattr(Detector, "check", watching)
    launcher = LocalLauncher()
    launcher.launch(old)
    new = None
    events: list[dict[str, Any]] = []  # the real watcher, over the channel, from the launch on
    watcher = threading.Thread(target=lambda: events.append(
        watch(old, Detection(straggler={"ratio": 50}), timeout=400)))
    watcher.start()
    try:
        _wait("a first checkpoint", lambda: lineage._published_dirs(old.run_id))
        assert stepping.wait(240), "the watcher never saw both ranks step"
        launcher.signal_node(Attempt(old.root), "node-a", signal.SIGSTOP)  # the node freezes
        watcher.join(timeout=120)
        assert events and events[0]["fault"]["kind"] == "node_unresponsive", events
        monkeypatch.setenv(ENV_PARTITIONED, "node-a")  # Relay's stop cannot reach it
        assert launcher.stop(Attempt(old.root), grace_seconds=1.0) == []
        accepted = lineage.fence_attempt(old.run_id, "replaced after node_unresponsive (try 1)")
        new = _attempt(lineage, parent, tmp_path, 2, "node-b", end_step=60)
        launcher.launch(new)  # the replacement, on another node
        launcher.signal_node(Attempt(old.root), "node-a", signal.SIGCONT)  # the partition heals

        # The retry's watcher reaches the old agent (a stale address). The old agent holds the
        # old attempt's channel secret: it refuses the retry's requests (401, naming nothing),
        # and the retry refuses it in turn, using nothing it could say.
        stale_address = launcher.channel(Attempt(old.root)).addresses["node-a"]
        launcher.channel(Attempt(new.root)).addresses["node-a"] = stale_address
        refused = _wait("a refused stale agent", lambda: [
            r for r in observe_attempt(new.root, node_ranks(new), 0.5, launcher).launch.refused
            if r["node"] == "node-a"])
        assert refused[0]["why"] == "refused our credential"  # type: ignore[index]
        assert refused[0]["found_attempt"] is None  # type: ignore[index]
        assert refused[0]["expected_attempt"] == attempt_id_of(new.root)  # type: ignore[index]
        assert launcher.channel(Attempt(new.root)).ask(
            "node-a", "drain", stop_at=99) is None  # 401
        assert 0 not in launcher.status(Attempt(new.root)).heartbeats or \
            launcher.status(Attempt(new.root)).heartbeats[0].node == "node-b"

        # A late checkpoint: the old attempt's rank 0 goes on publishing into its run.
        late = _wait("a late checkpoint", lambda: sorted(
            set(lineage._published_dirs(old.run_id)) - set(accepted)))
        latest, _corrupt = lineage.resume_point(parent, tmp_path / "download")
        assert latest is None or latest.manifest.run_id != old.run_id or \
            latest.manifest.ref.artifact_dir.rsplit("/", 1)[-1] in accepted
        tags = lineage.client.get_run(old.run_id).data.tags
        for step_dir in late:  # type: ignore[union-attr]
            assert tags[TAG_REJECTED + step_dir].startswith("fenced: published by attempt run")
    finally:
        monkeypatch.delenv(ENV_PARTITIONED, raising=False)
        launcher.signal_node(Attempt(old.root), "node-a", signal.SIGCONT)
        watcher.join(timeout=400)
        assert launcher.stop(Attempt(old.root), grace_seconds=2.0) == []
        if new is not None:
            assert launcher.stop(Attempt(new.root), grace_seconds=2.0) == []
