"""`relay demo`: run one job end to end through Airflow, show progress, say where to look."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relay.core import settings
from relay.core.attempt import Attempt
from relay.core.urls import redact
from relay.launchers.local.adopt import read_adopted, workload_of
from relay.launchers.local.prestart import CONF_KEY, prestart_resident
from relay.launchers.local.warm_agents import release
from relay.spec.job import JobSpec, load_job_spec, load_job_specs
from relay.tools.airflow_env import airflow_bin, airflow_env, ensure_airflow_db
from relay_train.protocol.routes import NodeState

# The three failure modes Relay exists for, one per segment of the demo job.
DEMO_FAULTS = [
    {"what": "a stalled rank (rank 1 stops stepping; its peers wait in the all-reduce)",
     "chaos": {"kind": "hang", "segment": 0, "step": 35, "rank": 1}},
    {"what": "an unresponsive node (every process of node-b is frozen with SIGSTOP)",
     "chaos": {"kind": "stop_node", "segment": 1, "step": 95, "node": "node-b"}},
    {"what": "a straggler (rank 3 on node-d computes 3x slower)",
     "chaos": {"kind": "straggler", "segment": 2, "step": 130, "rank": 3, "node": "node-d",
               "factor": 3.0}},
]


class DagTest(subprocess.Popen[bytes]):
    """``airflow dags test`` for one DAG run; once it has exited, the resident agent
    prestarted for it (``resident``) is stopped if the run did not stop it already."""

    resident: Path | None = None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to exit (see :meth:`subprocess.Popen.wait`)."""
        code = super().wait(timeout)
        self._release()
        return code

    def poll(self) -> int | None:
        """Return the exit code if the process has exited (see :meth:`subprocess.Popen.poll`)."""
        code = super().poll()
        if code is not None:
            self._release()
        return code

    def kill(self) -> None:
        """SIGKILL the process (see :meth:`subprocess.Popen.kill`): its DAG run is over."""
        super().kill()
        self._release()

    def terminate(self) -> None:
        """SIGTERM the process (see :meth:`subprocess.Popen.terminate`): the run is over."""
        super().terminate()
        self._release()

    def _release(self) -> None:
        if self.resident is not None:
            release(self.resident)
            self.resident = None


def starts_resident(dag_id: str, env: dict[str, str]) -> bool:
    """Return whether a DAG run of ``dag_id`` starts a resident agent on this host: the
    DAG of a job spec (in ``env``'s jobs folder) on the local launcher. Any other DAG
    (``relay_watch_external``, a Kubernetes job) would leave a prestarted one unused."""
    folder = Path(env.get("RELAY_JOBS_DIR") or settings.jobs_dir())
    if not folder.is_dir():
        return False
    specs, _ = load_job_specs(folder)
    return any(spec.dag_id == dag_id and spec.launcher == "local" for spec in specs.values())


def run_dag_test(
    dag_id: str, conf: dict[str, Any], env: dict[str, str], log_file: Path,
    prestart: bool = True,
) -> DagTest:
    """Start ``airflow dags test`` for one DAG run, its output going to ``log_file``.

    ``prestart``: start the run's resident agent first, if the run would start one
    (:func:`starts_resident`), so that it imports the training stack while Airflow
    starts (:mod:`relay.launchers.local.prestart`)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    resident = prestart_resident(Path(env["RELAY_HOME"]), dag_id, env) \
        if prestart and env.get("RELAY_HOME") and starts_resident(dag_id, env) else None
    try:
        if resident is not None:
            conf = {**conf, CONF_KEY: str(resident)}
        with log_file.open("ab") as out:
            proc = DagTest(
                [airflow_bin(), "dags", "test", dag_id, "-c", json.dumps(conf)],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
    except BaseException:
        if resident is not None:
            release(resident)
        raise
    proc.resident = resident
    return proc


class ProgressPrinter:
    """Print what the segments of the newest DAG run are doing, from their attempt folders."""

    def __init__(self, dag_dir: Path, total_steps: int, since: float,
                 spec: JobSpec | None = None) -> None:
        self.dag_dir = dag_dir
        self.spec = spec  # its launcher answers for the attempts (None: the local one)
        self.total_steps = total_steps
        self.since = since
        self.seen_tries: set[Path] = set()
        self.reported_end: set[Path] = set()
        self.last_step = -1
        self._launcher: Any = None  # the spec's launcher: the agents answer over their channel

    def _status(self, attempt: Path) -> Any:  # noqa: ANN401 - a LaunchStatus
        """Ask the attempt's node agents through the spec's launcher."""
        if self._launcher is None:
            from relay.launchers import launcher_for, launcher_from

            self._launcher = launcher_for(self.spec) if self.spec else launcher_from(None)
        return self._launcher.status(Attempt(attempt))

    def _tries(self) -> list[Path]:
        if not self.dag_dir.is_dir():
            return []
        runs = [p for p in self.dag_dir.iterdir() if p.stat().st_mtime >= self.since - 1]
        return sorted(
            (t for r in runs for t in r.glob("segment-*/try-*")
             if (t / "launch.json").exists() or read_adopted(t) is not None),
            key=lambda p: p.stat().st_mtime,
        )

    def poll(self) -> None:
        """Print new attempts, progress every few steps, and attempt outcomes."""
        for attempt in self._tries():
            name = f"{attempt.parent.name.replace('-', '_')} {attempt.name.replace('-', ' ')}"
            adopted = read_adopted(attempt)
            if adopted is not None and attempt not in self.seen_tries:
                self.seen_tries.add(attempt)
                workload = Path(adopted["workload"])
                print(f"  {name}: steps [{adopted['resume_step']}, {adopted['end_step']}): "
                      f"adopted the running workload of {workload.parent.name.replace('-', '_')} "
                      f"{workload.name.replace('-', ' ')} at step {adopted['at_step']}",
                      flush=True)
            workload = workload_of(attempt)
            launch = json.loads((workload / "launch.json").read_text())
            if attempt not in self.seen_tries:
                self.seen_tries.add(attempt)
                print(
                    f"  {name}: steps [{launch['start_step']}, {launch['end_step']}) on "
                    f"{', '.join(launch['nodes'])} x {launch['ranks_per_node']} ranks"
                    + (f", resuming from step {launch['resume']['step']}" if launch["resume"]
                       else ", from scratch"),
                    flush=True,
                )
            decision = attempt / "decision.json"
            if attempt not in self.reported_end and decision.exists():
                self.reported_end.add(attempt)
                record = json.loads(decision.read_text())
                fault, choice = record["fault"], record["decision"]
                who = f"rank {fault['culprit_rank']}" if fault["culprit_rank"] is not None else ""
                who = ", ".join(x for x in (who, fault["culprit_node"] or "") if x) or "job-wide"
                print(f"  {name}: FAULT {fault['kind']} ({who}): "
                      f"{fault['evidence'].get('summary', '')}", flush=True)
                print(f"    decision ({choice['rule']}): {choice['action']} - {choice['reason']}; "
                      f"lost steps: {record['lost_steps']}", flush=True)
                if record.get("rescued"):
                    kept = record["rescued"]
                    print(f"    resumes at step {kept['step']}: rank {kept['rank']} handed over "
                          f"the state it held in memory ({kept['checkpoint']})", flush=True)
                elif record.get("drained_at_step") is not None:
                    print(f"    resumes at step {record['drained_at_step']}: the ranks "
                          "checkpointed before stopping", flush=True)
                continue
            if attempt in self.reported_end:
                continue
            status = self._status(workload)
            states = {n.state for n in status.nodes.values()}
            # an agent says it is starting while it preloads
            live = {NodeState.STARTING, NodeState.RUNNING}
            if states and not states & live:
                if NodeState.FAILED not in states:
                    self.reported_end.add(attempt)
                continue  # a failure is reported once its decision is written
            beats = status.heartbeats
            if beats and attempt not in self.reported_end:
                step = min(b.step for b in beats.values())
                loss = beats[min(beats)].loss
                if step >= self.last_step + 10 or step < self.last_step:
                    self.last_step = step
                    loss_text = f"loss {loss:.3f}" if loss is not None else "starting"
                    print(f"    step {step:4d}/{self.total_steps}  {loss_text}", flush=True)




def where_to_look(job: str, parent: str) -> None:
    """Print the MLflow run, the checkpoint chain and the loss of one DAG run."""
    from relay.lineage.store import Lineage

    lineage = Lineage.from_settings()
    chain = lineage.chain(parent)
    children = lineage.child_runs(parent)
    losses = []
    for child in children:
        losses += [(m.step, m.value) for m in lineage.client.get_metric_history(
            child.info.run_id, "loss")]
    losses.sort()
    store = redact(lineage.tracking_uri, keep_query=True)  # never print a password
    print("\nWhere to look")
    print(f"  MLflow store:    {store}")
    print(f"  MLflow run:      {parent} (experiment relay/{job}), "
          f"{len(children)} segment attempt run(s)")
    print(f"  MLflow UI:       mlflow ui --backend-store-uri {store}")
    print("  Checkpoint chain (newest first):")
    for m in chain:
        origin = f"<- step {m.parent.step}" if m.parent else "<- initial weights (seed)"
        how = "" if m.origin == "periodic" else f"  ({m.origin})"
        print(f"    step {m.step:4d}  sha256 {m.sha256[:12]}  run {m.run_id[:8]}  {origin}{how}")
    if losses:
        print(f"  Loss:            {losses[0][1]:.3f} at step {losses[0][0]} -> "
              f"{losses[-1][1]:.3f} at step {losses[-1][0]}")


def summarize(job: str, dag_id: str, since: float) -> int:
    """Print where to look for the newest DAG run of ``dag_id``; return an exit code."""
    from relay.lineage.report import newest_parent
    from relay.lineage.store import Lineage

    parent = newest_parent(Lineage.from_settings(), job, dag_id, since)
    if parent is None:
        print("No MLflow run was recorded for this DAG; see the Airflow log above.")
        return 1
    where_to_look(job, parent)
    return 0


def run_once(spec: JobSpec, conf: dict[str, Any], env: dict[str, str], label: str) -> str | None:
    """Run one DAG run with progress; return its MLflow run id (None if it failed)."""
    from relay.lineage.report import newest_parent
    from relay.lineage.store import Lineage

    logs = settings.relay_home() / "logs"
    log_file = logs / f"airflow-dags-test-{label}-{int(time.time())}.log"
    print(f"\n{label}: `airflow dags test {spec.dag_id}` (task logs: {log_file})", flush=True)
    started = time.time()
    proc = run_dag_test(spec.dag_id, conf, env, log_file)
    progress = ProgressPrinter(settings.runs_dir() / spec.dag_id, spec.total_steps, started, spec)
    try:
        while proc.poll() is None:
            progress.poll()
            time.sleep(1.0)
    finally:  # interrupted (Ctrl-C): the DAG run ends here, its prestarted resident too
        if proc.poll() is None:
            proc.terminate()
    progress.poll()
    took = time.time() - started
    if proc.returncode != 0:
        print(f"{label}: the DAG run FAILED after {took:.0f}s (exit {proc.returncode}). "
              f"Read {log_file}.", file=sys.stderr)
        return None
    print(f"{label}: the DAG run succeeded in {took:.0f}s.", flush=True)
    return newest_parent(Lineage.from_settings(), spec.job, spec.dag_id, started)


def main(spec_file: Path, inject_fault: bool, launcher: str = "local") -> int:
    """Run the demo job (and its fault-free reference) with ``launcher`` (``local``:
    simulated nodes on this machine; ``slurm``: the Slurm test bed, relay.tools.demo_slurm);
    return the process exit code."""
    if launcher == "slurm":
        from relay.tools.demo_slurm import on_slurm, slurm_faults

        print("Relay demo on Slurm: the test bed's hosts, a real Slurm cluster", flush=True)
        with on_slurm(settings.relay_home(), spec_file) as slurm_spec:
            return run_demo(slurm_spec, inject_fault, slurm_faults(DEMO_FAULTS))
    return run_demo(spec_file, inject_fault, DEMO_FAULTS)


def run_demo(spec_file: Path, inject_fault: bool, faults: list[dict[str, Any]]) -> int:
    """Run the job of ``spec_file`` fault-free (the reference, once) and with ``faults``;
    print the fault table and whether the final weights are the reference's bit for bit."""
    import hashlib

    from relay.lineage.report import (
        fault_rows,
        final_state,
        format_fault_table,
        reference_run,
        same_bits,
    )
    from relay.lineage.store import Lineage
    from relay.nodes.pool import NodePool

    spec = load_job_spec(spec_file)
    home = settings.relay_home()
    env = airflow_env(home)
    print(f"Relay demo: job {spec.job!r} ({spec_file}), state in {home}", flush=True)
    print("  preparing the embedded Airflow database...", flush=True)
    ensure_airflow_db(env, home / "logs" / "airflow-db.log")
    pool = NodePool()
    for node in pool.quarantines():
        pool.release(node)  # the demo's simulated nodes start healthy every time
    kind = "simulated" if spec.launcher == "local" else spec.launcher
    print(f"  {kind} nodes: {', '.join(pool.nodes)} (all healthy)")
    lineage = Lineage.from_settings()
    if not inject_fault:
        parent = run_once(spec, {"chaos": []}, env, "run")
        if parent is None:
            return 1
        where_to_look(spec.job, parent)
        return 0

    spec_sha = hashlib.sha256(spec_file.read_bytes()).hexdigest()
    reference = reference_run(lineage, spec.job, spec_sha)
    if reference is None:
        print("\nFirst, a fault-free reference run of the same job (done once, then reused).")
        reference = run_once(spec, {"chaos": []}, env, "reference")
        if reference is None:
            return 1
    else:
        print(f"\nFault-free reference: MLflow run {reference} (reused from an earlier demo).")
    print("\nNow the same job with the three faults Relay exists for:")
    for fault in faults:
        print(f"  - {fault['what']}: {json.dumps(fault['chaos'])}")
    faulty = run_once(spec, {"chaos": [f["chaos"] for f in faults]}, env, "with faults")
    if faulty is None:
        return 1
    where_to_look(spec.job, faulty)
    print("\nFaults and recovery (detected after: from the fault to the watcher's event;")
    print("time to resume: from the fault to the retry's first productive step, detection "
          "included)")
    print(format_fault_table(fault_rows(lineage, faulty)))
    with tempfile.TemporaryDirectory() as tmp:
        a = final_state(lineage, reference, Path(tmp) / "reference")
        b = final_state(lineage, faulty, Path(tmp) / "faulty")
    equal, detail = same_bits(a, b) if a and b else (False, "a final checkpoint is missing")
    verdict = "YES" if equal else "NO"
    print(f"\nFinal weights equal the fault-free run's, bit for bit: {verdict} ({detail})")
    return 0 if equal else 1
