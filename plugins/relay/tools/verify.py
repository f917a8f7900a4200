"""`relay verify`: run a job without and with an injected fault; are the results bit-exact?

Both runs go through Airflow like ``relay demo`` (``airflow dags test`` on an embedded
database, the local launcher); a fault-free run of the same spec already in MLflow is
reused. The two final checkpoints are compared leaf by leaf
(:mod:`relay.lineage.compare`): the verdict is "bit-exact", or the first tensor that
differs, with the element's index and both values.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from relay.core import settings
from relay.core.exceptions import ChaosConfError
from relay.lineage.compare import RNG_KEY, count_tensors, first_difference
from relay.spec.chaos_conf import chaos_faults
from relay.spec.job import JobSpec, load_job_spec
from relay_train.protocol.injection import KINDS

DEFAULT_KIND = "hang"
FAULT_KINDS = tuple(k for k in KINDS if k not in ("pace", "jitter"))  # those are slowness


def default_fault(spec: JobSpec, kind: str = DEFAULT_KIND, *, rank: int | None = None,
                  step: int | None = None, node: str | None = None) -> dict[str, Any]:
    """Return the fault ``relay verify`` injects: by default one rank (the last) hangs
    half-way through the middle segment, on that segment's first try."""
    if step is None:
        _, start, end = spec.segments[len(spec.segments) // 2]
        step = start + max(1, (end - start) // 2)
    segment = next(index for index, start, end in spec.segments if start <= step < end)
    fault: dict[str, Any] = {"kind": kind, "segment": segment, "step": step, "attempt": 1}
    if node is not None:
        fault["node"] = node
    elif kind != "stop_node":
        fault["rank"] = spec.world_size - 1 if rank is None else rank
    if kind == "straggler":
        fault["factor"] = 3.0
    return fault


def check_fault(spec: JobSpec, spec_file: Path, fault: dict[str, Any]) -> str | None:
    """Return why ``fault`` cannot be injected into this job, or None."""
    if fault["kind"] == "stop_node" and "node" not in fault:
        return ("relay verify --fault stop_node: expected --node NAME (the node to freeze, "
                "e.g. --node node-b); found none")
    if not 0 <= fault["step"] < spec.total_steps:
        return (f"relay verify --step: expected a step from 0 to {spec.total_steps - 1} "
                f"(the job's total_steps is {spec.total_steps}); found {fault['step']}")
    try:
        chaos_faults({"chaos": [fault]}, spec, spec_file)
    except ChaosConfError as exc:
        return str(exc)
    return None


def verdict(reference: dict[str, Any], faulty: dict[str, Any]) -> tuple[bool, list[str]]:
    """Compare two final checkpoints; return (bit-exact, the lines that say so).

    The RNG states are not compared: a generator the script never seeds (NumPy's, say)
    starts from the OS's entropy in every process, so two fault-free runs differ there.
    """
    script = frozenset({RNG_KEY})
    found = first_difference(reference, faulty, skip=script)
    if found is not None:
        return False, ["NOT bit-exact. First difference at "
                       + found.describe("fault-free", "with the fault")]
    kept = ", ".join(k for k in reference if k not in ("step", RNG_KEY))
    ranks = [len(state.get(RNG_KEY, {}).get("ranks", {})) for state in (reference, faulty)]
    return True, [f"bit-exact: step {reference['step']}, "
                  f"{count_tensors(reference, script)} tensors ({kept}) identical",
                  f"  (RNG states saved for {ranks[0]} and {ranks[1]} ranks; not compared)"]


def _release_new_quarantines(before: set[str]) -> None:
    """Lift the quarantines this verification's runs caused (simulated local nodes)."""
    from relay.nodes.pool import NodePool

    pool = NodePool()
    for node in sorted(set(pool.quarantines()) - before):
        pool.release(node)
        print(f"  released the quarantine of {node} that this run caused")


def spec_path(job: str) -> Path | None:
    """Return the spec file ``job`` names: a path, or a job's name in the jobs folder."""
    from relay.spec.job import load_job_specs

    if Path(job).is_file():
        return Path(job)
    folder = settings.jobs_dir()
    if not folder.is_dir():
        return None
    specs, _ = load_job_specs(folder)
    return next((path for path, spec in specs.items() if spec.job == job), None)


def main(spec_file: Path, fault: dict[str, Any] | None = None, *, kind: str = DEFAULT_KIND,
         rank: int | None = None, step: int | None = None, node: str | None = None) -> int:
    """Verify one job spec; return the exit code (0: bit-exact)."""
    from relay.lineage.report import fault_rows, final_state, format_fault_table, reference_run
    from relay.lineage.store import Lineage
    from relay.nodes.pool import NodePool
    from relay.tools.airflow_env import airflow_env, ensure_airflow_db
    from relay.tools.demo import run_once

    spec_file = Path(spec_file).resolve()
    spec = load_job_spec(spec_file)
    fault = fault or default_fault(spec, kind, rank=rank, step=step, node=node)
    problem = check_fault(spec, spec_file, fault)
    if problem is not None:
        print(problem)
        return 2
    if spec.launcher != "local":
        print(f"relay verify: {spec_file}: expected launcher: local (verify runs both DAG "
              f"runs on this machine, as relay demo does); found {spec.launcher}. Verify a "
              "copy of the spec with launcher: local.")
        return 2
    home = settings.relay_home()
    os.environ["RELAY_JOBS_DIR"] = str(spec_file.parent)  # the DAG file reads the spec there
    env = airflow_env(home)
    print(f"relay verify: job {spec.job!r} ({spec_file}), state in {home}", flush=True)
    ensure_airflow_db(env, home / "logs" / "airflow-db.log")
    lineage = Lineage.from_settings()
    spec_sha = hashlib.sha256(spec_file.read_bytes()).hexdigest()
    reference = reference_run(lineage, spec.job, spec_sha)
    quarantined = set(NodePool().quarantines())
    if reference is None:
        try:  # a loaded machine can make a fault-free run fault too (and quarantine)
            reference = run_once(spec, {"chaos": []}, env, "fault-free run")
        finally:
            _release_new_quarantines(quarantined)
        if reference is None:
            return 1
    else:
        print(f"\nfault-free run: MLflow run {reference} (reused: same spec, no fault)")
    print(f"\nwith a fault: {json.dumps(fault)}")
    try:
        faulty = run_once(spec, {"chaos": [fault]}, env, "with the fault")
    finally:
        _release_new_quarantines(quarantined)
    if faulty is None:
        return 1
    print(format_fault_table(fault_rows(lineage, faulty)))
    with tempfile.TemporaryDirectory() as tmp:
        a = final_state(lineage, reference, Path(tmp) / "reference")
        b = final_state(lineage, faulty, Path(tmp) / "faulty")
    if a is None or b is None:
        print("\nNOT bit-exact: a final checkpoint is missing "
              f"(fault-free: {'found' if a else 'none'}, with the fault: "
              f"{'found' if b else 'none'})")
        return 1
    exact, lines = verdict(a, b)
    print(f"\nfault-free run {reference} vs run with the fault {faulty}:")
    print("\n".join(lines))
    return 0 if exact else 1

