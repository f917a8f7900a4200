"""The watcher on real 4-rank DDP workloads: every fault kind, its culprit, and no false alarms."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from relay.policy.model import Detection, HangFromStepTime
from relay.tools.airflow_env import airflow_env, ensure_airflow_db
from relay.tools.bench.common import Store, launch_config, launched, watch
from relay.tools.bench.detect import SCENARIOS, Scenario, run_trial
from relay.tools.demo import run_dag_test
from relay_train.protocol.heartbeat import HeartbeatWriter, Phase, read_heartbeats

pytestmark = pytest.mark.integration

# Generous bounds that only catch a broken detector; figures come from `relay bench detect`.
DETECTION_BOUND_SECONDS = {
    "hang": 30, "rank_unresponsive": 30, "node_unresponsive": 30, "crash": 30,
    "straggler": 60, "throughput_degraded": 90, "nan_loss": 30, "launch_failure": 60,
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return Store(tmp_path_factory.mktemp("mlflow"))


# hang, node and crash are exercised end to end elsewhere (the Airflow recovery tests and
# `relay chaos` below); these are the kinds only this test injects for real.
# The straggler at 3x, not the benchmark's 2x: on the tiny model a rank's compute is a few
# ms of each step, and at 2x its measured ratio flickers around the 1.5x threshold, which
# restarts the rule's clock (detection took 3-53 s in `relay bench detect`). This test is
# about the classification and its culprit; how fast a 2x straggler is seen is the bench's.
ONLY_HERE = [dataclasses.replace(s, fault={**s.fault, "factor": 3.0}) if s.name == "straggler"
             else s for s in SCENARIOS
             if s.name in ("rank", "straggler", "throughput", "nan", "launch")]


@pytest.mark.parametrize("scenario", ONLY_HERE, ids=[s.name for s in ONLY_HERE])
def test_fault_is_classified_with_its_culprit(
    scenario: Scenario, store: Store, tmp_path: Path
) -> None:
    # Only the launch scenario is about start-up: it gets a short limit to be detected by.
    # The others get a long one, so a slow start on a busy machine (preloading torch takes
    # seconds there) is not mistaken for a launch failure before their fault is injected.
    startup = 10.0 if scenario.expected_kind == "launch_failure" else 90.0
    record = run_trial(store, tmp_path / "attempt", scenario, Detection(startup_timeout=startup))
    assert record["status"] == "faulted", record
    assert record["kind"] == scenario.expected_kind, record
    assert record["culprit"] == (scenario.culprit_rank, scenario.culprit_node), record
    assert record["latency"] is not None
    assert 0 <= record["latency"] < DETECTION_BOUND_SECONDS[scenario.expected_kind], record


def test_step_time_jitter_raises_no_false_alarm(store: Store, tmp_path: Path) -> None:
    # Every rank loses up to 60 ms per step at random, for 180 steps. Two watchers at once on
    # the one workload (watching twice is harmless): the hang timeout as written, and derived.
    jitter = {"kind": "jitter", "step": 0, "seconds": 0.06, "attempt": None}
    cfg = launch_config(store, tmp_path / "attempt", steps=180, chaos=[jitter])
    detections = {"as-written": Detection(),
                  "derived-hang-timeout": Detection(derive_hang_timeout=HangFromStepTime())}
    with launched(cfg), ThreadPoolExecutor(len(detections)) as pool:
        watching = {name: pool.submit(watch, cfg, detection, 240)
                    for name, detection in detections.items()}
        events = {name: future.result() for name, future in watching.items()}
    for name, event in events.items():
        assert event["status"] == "completed", (name, event)


@pytest.mark.slow  # a whole 2-node launch: 60-130 s; unit-tested in test_port_taken
def test_a_taken_rendezvous_port_blames_nobody(store: Store, tmp_path: Path) -> None:
    # Another process holds the rendezvous port before the launch: rank 0's store cannot
    # listen on it (EADDRINUSE) and the rank dies before its first step.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cfg = dataclasses.replace(launch_config(store, tmp_path / "attempt", steps=20),
                                  master_port=port)
        with launched(cfg):
            event = watch(cfg, Detection(startup_timeout=120.0), timeout=210.0)
    assert event["status"] == "faulted", event
    fault = event["fault"]
    assert fault["kind"] == "launch_failure", fault
    assert (fault["culprit_rank"], fault["culprit_node"]) == (None, None), fault
    assert fault["evidence"]["port_taken"] == port, fault


def _simulate_job(folder: Path, ranks: int, silent_rank: int | None, seconds: float) -> None:
    writers = [HeartbeatWriter(folder, r, f"host-{r // 2}", 0.2).start() for r in range(ranks)]
    started = time.time()
    step = 0
    while time.time() - started < seconds:
        step += 1
        for r, w in enumerate(writers):
            if r == silent_rank and step >= 10:
                w._stop.set()  # the rank's process froze: no more records at all
                continue
            w.enter(Phase.COMPUTE)
            w.beat(step=step, compute_seconds=0.05, samples_per_second=100.0, loss=2.0)
        time.sleep(0.1)
    for r, w in enumerate(writers):
        if r != silent_rank:
            w.close()


@pytest.mark.parametrize("silent_rank", [None, 1], ids=["healthy", "silent-rank"])
def test_sensors_watch_a_job_relay_did_not_launch(
    silent_rank: int | None, relay_home: Path, tmp_path: Path
) -> None:
    env = airflow_env(relay_home)
    ensure_airflow_db(env, relay_home / "logs" / "airflow-db.log")
    env["RELAY_WATCH_ROOTS"] = str(tmp_path)  # the run conf's heartbeat_dir must be under it
    folder = tmp_path / "heartbeats"
    job = threading.Thread(target=_simulate_job, args=(folder, 4, silent_rank, 12.0))
    job.start()
    log_file = relay_home / "logs" / f"sensor-{silent_rank}.log"
    conf = {"heartbeat_dir": str(folder), "world_size": 4}
    proc = run_dag_test("relay_watch_external", conf, env, log_file)
    try:
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        job.join()
    log = log_file.read_text()
    if silent_rank is None:
        assert code == 0, log[-4000:]
    else:
        assert code != 0
        assert "rank_unresponsive (node host-0, rank 1)" in log, log[-4000:]


def _wait_for_step(attempt: Path, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beats = read_heartbeats(attempt / "heartbeats")
        if len(beats) == 4 and min(b.step for b in beats.values()) >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"ranks did not reach step {step} in {timeout}s")


# A workload whose steps are mostly compute, as real training's are. The outside slow-rank
# case timed out inside the full suite (and on any busy machine); the detector's view, poll
# by poll, showed why: on the tiny model a step is ~8 ms of compute in a much longer gloo
# all-reduce, so the freezes landed in the collective, which is not compute time, and the
# slowed rank's compute ratio flickered around 1.5x, restarting the 3 s sustained clock;
# and with a 100 ms freeze period a saturated machine gave most of the lost CPU back
# (--factor 3 slowed compute ~1.4x; `relay chaos` now freezes per 500 ms).
COMPUTE_BOUND_MODEL = {"context": 64, "d_model": 128, "n_layers": 2, "n_heads": 4, "dropout": 0.1}


@pytest.mark.parametrize(
    ("command", "kind", "culprit"),
    [
        (["kill-rank", "1"], "crash", (1, "node-a")),
        # `make test` sees a frozen node called node_unresponsive in test_channel_runs (the
        # same SIGSTOP of a node's process group, the real watcher); this one, the culprit
        # among two nodes, runs in `make test-slow` with the frozen-node recoveries.
        pytest.param(["stop-node", "node-b"], "node_unresponsive", (None, "node-b"),
                     marks=pytest.mark.slow),
        (["slow-rank", "2", "--factor", "3", "--seconds", "25"], "straggler", (2, "node-b")),
    ],
    ids=["kill-rank", "stop-node", "slow-rank"],
)
def test_relay_chaos_from_outside_is_detected(
    command: list[str], kind: str, culprit: tuple[int | None, str], store: Store, tmp_path: Path
) -> None:
    cfg = launch_config(store, tmp_path / "attempt", steps=100_000, model=COMPUTE_BOUND_MODEL,
                        batch_size=16)
    with launched(cfg) as launched_attempt:
        attempt = launched_attempt.folder
        _wait_for_step(attempt, 20)
        relay = Path(sys.executable).with_name("relay")
        chaos = subprocess.Popen([str(relay), "chaos", *command, "--attempt-dir", str(attempt)])
        try:
            event = watch(cfg, Detection(), timeout=60)
        finally:
            chaos.kill()
            chaos.wait()
    assert event["status"] == "faulted", event
    assert event["fault"]["kind"] == kind, event
    assert (event["fault"]["culprit_rank"], event["fault"]["culprit_node"]) == culprit
