"""The culprit bench: stall each rank of a tiny job in turn; whom do phases and evidence blame?

One case (:func:`run_case`): ``world`` real gloo ranks (:mod:`culprit_worker`) train a
model of one kind; at step 3 one rank stalls before its forward (in its backward for
``fsdp2_backward``). Once every rank
reached that step, Relay's :class:`~relay.watch.detection.Detector` watches the
heartbeats until it calls the hang (the *heartbeat culprit*); then every rank is
asked for its stacks and Flight Recorder trace, as the recovery pipeline does, and
:func:`~relay.recover.culprit.confirm_culprit` gives the culprit Relay acts on.

Run it for the table in docs/watching.md::

    .venv/bin/python tests/integration/culprit_bench.py [ddp_buffers:4:no ...]
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

from relay.core.faults import FaultKind
from relay.policy.model import Detection
from relay.recover.culprit import CULPRIT_CHECK, confirm_culprit
from relay.recover.evidence import Evidence
from relay.watch.detection import Detector
from relay.watch.observation import Observation
from relay_train.protocol.heartbeat import read_heartbeats, write_atomically
from relay_train.protocol.routes import REQUEST_ID
from relay_train.protocol.stacks_files import EVIDENCE_DIR, REQUEST_FILE, answer_path, trace_path

WORKER = Path(__file__).with_name("culprit_worker.py")
STALL_STEP = 3
HANG_TIMEOUT = 1.5
WAIT_SECONDS = 300.0  # start-up on a shared machine (importing torch, FSDP) is slow
# (model, world size, mark the forward collectives) for the table
CASES = [("ddp_buffers", 3, True), ("ddp_buffers", 3, False), ("ddp_buffers", 4, False),
         ("fsdp2", 2, True), ("fsdp2", 2, False), ("fsdp2_backward", 2, True),
         ("fsdp2_backward", 2, False), ("metric", 2, True)]


@dataclass
class CaseResult:
    """Who was blamed for one stalled rank."""

    model: str
    world: int
    marked: bool
    stalled: int
    heartbeat_culprit: int | None  # the watcher's, from the phases
    culprit: int | None  # after the evidence
    summary: str
    note: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill each rank's process group (its own session) by its PID."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)


def _await(what: str, done: object, procs: list[subprocess.Popen[bytes]], folder: Path) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not done():  # type: ignore[operator]
        dead = [p.args for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join((folder / f"log{r}").read_text()[-2000:] for r in range(len(procs)))
            raise RuntimeError(f"expected {what} within {WAIT_SECONDS:g}s; found "
                               f"{'exited ranks' if dead else 'none'}. Logs:\n{logs}")
        time.sleep(0.05)


def run_case(model: str, world: int, stalled: int, marked: bool, folder: Path) -> CaseResult:
    """Run one case in ``folder``; stop every rank before returning."""
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "TORCH_FR_BUFFER_SIZE": "2000"}
            args = [sys.executable, str(WORKER), "--model", model, "--stall", str(stalled),
                    "--stall-step", str(STALL_STEP), "--dir", str(folder)]
            with (folder / f"log{rank}").open("wb") as log:
                procs.append(subprocess.Popen(args + (["--mark"] if marked else []), env=env,
                                              stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        beats = folder / "heartbeats"

        def at_stall() -> bool:
            seen = read_heartbeats(beats) if beats.is_dir() else {}
            return len(seen) == world and all(b.step == STALL_STEP for b in seen.values())

        _await(f"every rank at step {STALL_STEP}", at_stall, procs, folder)
        detector = Detector(Detection(hang_timeout=HANG_TIMEOUT, heartbeat_timeout=60.0,
                                      startup_timeout=WAIT_SECONDS, straggler=None,
                                      throughput=None), frozenset({FaultKind.HANG}))
        nodes = {f"node{r}": [r] for r in range(world)}
        found: list = []

        def called() -> bool:
            obs = Observation(time.time(), 0.0, read_heartbeats(beats), nodes, 0.1)
            fault = detector.check(obs)
            if fault is not None:
                found.append(fault)
            return fault is not None

        _await("a hang", called, procs, folder)
        fault = found[0]
        asked = folder / EVIDENCE_DIR
        write_atomically(asked / REQUEST_FILE, json.dumps({REQUEST_ID: "bench"}))
        _await("every rank's stacks", lambda: all(
            answer_path(asked, r).is_file() for r in range(world)), procs, folder)
        answers = {r: json.loads(answer_path(asked, r).read_text()) for r in range(world)}
        traces = {r: json.loads(trace_path(asked, r).read_text()) for r in range(world)
                  if trace_path(asked, r).is_file()}
        evidence = Evidence(asked, answers, traces, {}, [], 0.0)
        confirmed = confirm_culprit(fault, evidence, list(range(world)), lambda r: f"node{r}")
        return CaseResult(model, world, marked, stalled, fault.culprit_rank,
                          confirmed.culprit_rank, fault.evidence["summary"],
                          confirmed.evidence.get(CULPRIT_CHECK, {}).get("note", ""))
    finally:
        _stop(procs)


def table(results: list[CaseResult]) -> str:
    """Return the accuracy table (markdown): one row per model, one column per stalled rank."""
    def who(rank: int | None) -> str:
        return "none" if rank is None else str(rank)

    worlds = max(r.world for r in results)
    head = "| model (ranks, forward collectives marked) | " + " | ".join(
        f"rank {s} stalled" for s in range(worlds)) + " |"
    rows = [head, "|" + "---|" * (worlds + 1)]
    keys = list(dict.fromkeys((r.model, r.world, r.marked) for r in results))
    for model, world, marked in keys:
        cells = []
        for s in range(worlds):
            hit = [r for r in results if (r.model, r.world, r.marked, r.stalled)
                   == (model, world, marked, s)]
            cells.append("" if not hit else f"phases: {who(hit[0].heartbeat_culprit)}, "
                         f"confirmed: {who(hit[0].culprit)}"
                         + (" ✓" if hit[0].culprit == s else " ✗"))
        rows.append(f"| {model} ({world}, {'yes' if marked else 'no'}) | " + " | ".join(cells)
                    + " |")
    return "\n".join(rows)


def main(only: list[str]) -> None:
    """Run every case (or those named ``model:world:yes|no``); print the table and notes."""
    results = []
    for model, world, marked in CASES:
        if only and f"{model}:{world}:{'yes' if marked else 'no'}" not in only:
            continue
        for stalled in range(world):
            with TemporaryDirectory(prefix="culprit-") as tmp:
                result = run_case(model, world, stalled, marked, Path(tmp))
            print(f"{model} world {world} marked {marked} stalled {stalled}: "
                  f"{result.summary} -> {result.note}", flush=True)
            results.append(result)
    print(table(results))


if __name__ == "__main__":
    main(sys.argv[1:])
