"""`relay bench detect`: latency from an injected fault to the watcher's event, per kind.

Each trial launches 2 nodes x 2 ranks of the tiny model (real DDP over gloo,
real heartbeats), injects one fault, and runs the real ``SegmentWatchTrigger``
until it fires. Latency is the event's detection time minus the moment the
rank recorded the strike (for a launch failure: minus the launch, since "no
heartbeat within the start-up timeout" cannot be seen earlier).

Each kind is set against what notices it without Relay, on the same loop under
plain torchrun: gloo's collective timeout for a hang, a stopped rank or a frozen
node (30 min by default; the peers raise after exactly the timeout, measured in
/work/shared/ENVIRONMENT.md, so the figure is the timeout itself); the rendezvous
timeout (the same setting) for a rank that never starts; the connection reset
for a crash, measured here per repeat as the time from the strike to the first
torchrun exiting, with one torchrun per node (see
:mod:`relay.tools.bench.torchrun_baseline`); and nothing at all for a straggler, a
NaN loss or a job-wide slowdown: training just goes on, slower or poisoned.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.core.attempt import AttemptState
from relay.launchers.local.launcher import LocalLauncher
from relay.lineage.report import chaos_strikes
from relay.policy.model import Detection, load_policy
from relay.spec.policy_files import policies_dir
from relay.tools.bench.common import Store, launch_config, launched, summary, watch

GLOO_DEFAULT_TIMEOUT_SECONDS = 1800.0
# What notices each scenario without Relay (None: nothing does).
WITHOUT_RELAY = {
    "hang": "gloo collective timeout", "rank": "gloo collective timeout",
    "node": "gloo collective timeout", "launch": "rendezvous timeout (the same setting)",
    "crash": "connection reset (measured under torchrun)",
    "straggler": None, "throughput": None, "nan": None,
}


@dataclass(frozen=True)
class Scenario:
    """One fault kind as injected, and what the watcher must call it."""

    name: str
    fault: dict[str, Any]
    expected_kind: str
    culprit_rank: int | None
    culprit_node: str | None


SCENARIOS = (
    Scenario("hang", {"kind": "hang", "step": 30, "rank": 1}, "hang", 1, "node-a"),
    Scenario("rank", {"kind": "stop_rank", "step": 30, "rank": 2}, "rank_unresponsive", 2,
             "node-b"),
    Scenario("node", {"kind": "stop_node", "step": 30, "node": "node-b", "rank": 3},
             "node_unresponsive", None, "node-b"),
    Scenario("crash", {"kind": "crash", "step": 30, "rank": 1}, "crash", 1, "node-a"),
    Scenario("straggler", {"kind": "straggler", "step": 30, "rank": 3, "factor": 2.0},
             "straggler", 3, "node-b"),
    # Every rank loses 100 ms a step (the tiny model's step is ~20 ms) once the job's
    # baseline is known (10 warm-up steps, then 5 s): the whole job slows down.
    Scenario("throughput", {"kind": "pace", "step": 600, "seconds": 0.1},
             "throughput_degraded", None, None),
    Scenario("nan", {"kind": "nan", "step": 30, "rank": 2}, "nan_loss", 2, "node-b"),
    Scenario("launch", {"kind": "launch_failure", "rank": 0}, "launch_failure", 0, "node-a"),
)


def run_trial(store: Store, root: Path, scenario: Scenario, detection: Detection) -> dict[str, Any]:
    """Inject one fault and time the watcher; return the trial's record."""
    cfg = launch_config(store, root, steps=100_000, chaos=[scenario.fault])
    with launched(cfg) as attempt:
        event = watch(cfg, detection, timeout=detection.startup_timeout + 90)
        launched_at = LocalLauncher().started_at(attempt)
        strikes = chaos_strikes(attempt.folder)
    record: dict[str, Any] = {"scenario": scenario.name, "status": event.get("status")}
    if event.get("status") != AttemptState.FAULTED:
        return {**record, "ok": False, "latency": None}
    fault = event["fault"]
    onset = launched_at if scenario.expected_kind == "launch_failure" else (
        min(s["at"] for s in strikes) if strikes else None
    )
    latency = fault["detected_at"] - onset if onset is not None else None
    ok = (
        fault["kind"] == scenario.expected_kind
        and fault["culprit_rank"] == scenario.culprit_rank
        and fault["culprit_node"] == scenario.culprit_node
    )
    return {**record, "ok": ok, "latency": latency, "kind": fault["kind"],
            "culprit": (fault["culprit_rank"], fault["culprit_node"]),
            "summary": fault["evidence"].get("summary", "")}


def torchrun_crash_trial(root: Path) -> float | None:
    """Crash rank 1 under supervised torchrun; return strike -> first torchrun exit."""
    from relay.tools.bench.common import TINY_MODEL
    from relay.tools.bench.torchrun_baseline import run_baseline

    job = {"seed": 1, "model": TINY_MODEL, "data": {"corpus": "builtin:python_docs",
           "batch_size": 8}, "optimizer": {"lr": 0.003}, "steps": 40, "every": 10,
           "nodes": 2, "ranks_per_node": 2}
    schedule = [{"kind": "crash", "step": 30, "rank": 1, "attempt": None, "once": True}]
    run = run_baseline(root, job, schedule, ["node-a", "node-b"], GLOO_DEFAULT_TIMEOUT_SECONDS)
    return run.recoveries[0].detected_after if run.recoveries else None


def _without_relay(scenario: str, crash: list[float]) -> str:
    what = WITHOUT_RELAY[scenario]
    if what is None:
        return "never (nothing notices; training goes on)"
    if scenario == "crash":
        med, worst = summary(crash)
        return f"{what}: median {med:.2f}s, max {worst:.2f}s" if crash else f"{what}: -"
    return f"{what}: {GLOO_DEFAULT_TIMEOUT_SECONDS:g}s by default (or whatever it is set to)"


def thresholds(policy: str | None, startup_timeout: float) -> tuple[Detection, Path]:
    """Return the policy's detection thresholds (default: the shipped default policy)."""
    path = Path(policy) if policy else policies_dir() / "default.yaml"
    detection = load_policy(path).policy.detection
    return detection.model_copy(update={"startup_timeout": startup_timeout}), path


def main(repeats: int = 5, only: list[str] | None = None, startup_timeout: float = 20.0,
         policy: str | None = None) -> int:
    """Run every scenario ``repeats`` times and print latencies next to what else notices."""
    detection, path = thresholds(policy, startup_timeout)
    chosen = [s for s in SCENARIOS if not only or s.name in only]
    derived = ("derived from the job's step time" if detection.derive_hang_timeout
               else f"{detection.hang_timeout:g}s as written")
    print(f"Detection benchmark: {repeats} trial(s) per fault kind, 2 nodes x 2 ranks, "
          f"thresholds of {path} (hang: {derived}; startup_timeout {startup_timeout:g}s for "
          "the launch trials); "
          "latency = the watcher's event - the injected strike. Compared with what notices the "
          "same fault without Relay, under plain torchrun: gloo's collective timeout, the "
          "connection reset after a crash (measured below), or nothing", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="relay-bench-detect-") as tmp:
        store = Store(Path(tmp))
        for scenario in chosen:
            records = []
            for i in range(repeats):
                started = time.time()
                rec = run_trial(store, Path(tmp) / f"{scenario.name}-{i}", scenario, detection)
                records.append(rec)
                lat = f"{rec['latency']:.2f}s" if rec["latency"] is not None else "-"
                print(f"  {scenario.name:10} #{i + 1}: {rec.get('kind', rec['status']):20} "
                      f"culprit {rec.get('culprit')} latency {lat} "
                      f"({'ok' if rec['ok'] else 'WRONG'}; trial {time.time() - started:.0f}s)",
                      flush=True)
            rows.append((scenario, records))
        crash: list[float] = []
        if any(s.name == "crash" for s in chosen):
            for i in range(repeats):
                seconds = torchrun_crash_trial(Path(tmp) / f"torchrun-crash-{i}")
                print(f"  crash under torchrun #{i + 1}: first torchrun exit after "
                      f"{'-' if seconds is None else f'{seconds:.2f}s'}", flush=True)
                if seconds is not None:
                    crash.append(seconds)
    print(f"\n  {'fault':19} {'correct':>8} {'median':>8} {'max':>8}   without Relay, what notices "
          "it and when")
    all_ok = True
    for scenario, records in rows:
        lats = [r["latency"] for r in records if r["ok"] and r["latency"] is not None]
        correct = sum(r["ok"] for r in records)
        all_ok = all_ok and correct == len(records)
        med, worst = summary(lats)
        cells = f"{med:7.2f}s {worst:7.2f}s" if lats else f"{'-':>8} {'-':>8}"
        print(f"  {scenario.expected_kind:19} {correct:>4}/{len(records):<3} {cells}   "
              f"{_without_relay(scenario.name, crash)}")
    return 0 if all_ok else 1
