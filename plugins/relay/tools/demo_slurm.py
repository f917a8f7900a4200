"""`relay demo --launcher slurm`: the demo job, its faults and its checks on the Slurm test bed.

The same job as the local demo (``dags/jobs/demo.yaml``, as ``demo_slurm`` with
``launcher: slurm``) and the same three faults, on hosts node1..node5 that cannot read
Relay's disk (RELAY_HOME is hidden in each): the launch file travels in the batch script,
the ranks fetch resume checkpoints from an MLflow server in the root namespace over the
bridge (198.18.0.1) and verify them, and send their logs to MLflow; the chaos log and rank
0's first step come back over the agents' channel. Airflow (``airflow dags test``) runs in
the root namespace; nothing on the nodes reaches it.

The bed: the one `relay testbed up --nodes 5` (``make cluster-up NODES=5``) made, if it is
up; else the demo brings one up under the machine's test-bed lease and takes it down at the
end. Five nodes, as the local demo's five simulated ones: each fault's culprit node is
quarantined (drained in Slurm), and every retry still needs two healthy nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relay.tools.testbed import TestBed

NODES = 5
# The local demo's simulated nodes are the bed's nodes, in the same order.
NODE_NAMES = {f"node-{chr(ord('a') + i)}": f"node{i + 1}" for i in range(NODES)}
JOB = "demo_slurm"
LINGER_SECONDS = 5.0  # an agent answers this long after its ranks end (Relay reads the end)


# Each Slurm segment is a fresh allocation, whose ranks the straggler rule does not judge
# for their first `sustained` (3 s): the local demo's 3x straggler, struck 50 steps before
# the job's end, was called ~4.3 s later at about step 173, and its checkpoint-and-migrate
# then fell on the job's end, with no retry to measure (or, once, the segment ended first:
# docs/slurm.md). On Slurm it computes 5x slower: called as soon, fewer steps in.
SLURM_STRAGGLER_FACTOR = 5.0


def slurm_faults(faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return the local demo's faults with their nodes named as on the bed (the straggler
    :data:`SLURM_STRAGGLER_FACTOR` x slower)."""
    def renamed(text: str) -> str:
        for local, bed in NODE_NAMES.items():
            text = text.replace(local, bed)
        return text.replace("3x slower", f"{SLURM_STRAGGLER_FACTOR:g}x slower")

    def chaos(fault: dict[str, Any]) -> dict[str, Any]:
        out = {**fault, **({"node": NODE_NAMES[fault["node"]]} if "node" in fault else {})}
        if out["kind"] == "straggler":
            out["factor"] = SLURM_STRAGGLER_FACTOR
        return out

    return [{"what": renamed(f["what"]), "chaos": chaos(f["chaos"])} for f in faults]


def slurm_spec(local_spec: Path, bed: TestBed, folder: Path) -> Path:
    """Write the demo's spec for the bed into ``folder``; return its path."""
    from relay.tools.testbed.slurm import slurm_env

    lines = [line for line in local_spec.read_text().splitlines()
             if not line.startswith("job:")]
    slurm = {"node_home": f"{bed.folder}/hosts/{{node}}/attempts", "python": sys.executable,
             "slurm_conf": slurm_env(bed)["SLURM_CONF"], "linger": LINGER_SECONDS}
    text = "\n".join([f"job: {JOB}", *lines, "launcher: slurm", "slurm:",
                      *(f"  {k}: {json.dumps(v)}" for k, v in slurm.items()), ""])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{JOB}.yaml"
    path.write_text(text)
    return path


@contextlib.contextmanager
def bed_for_demo(home: Path) -> Iterator[TestBed]:
    """Yield the test bed `relay testbed up` made (if up), else one of our own (under the
    lease, RELAY_HOME hidden in its hosts, taken down at the end)."""
    from relay.tools.cli_testbed import load_bed
    from relay.tools.testbed import hosts, slurm
    from relay.tools.testbed.lease import lease

    bed = load_bed()
    if bed is not None:
        found = sorted(n for n in bed.hosts if n != slurm.CONTROLLER)
        missing = [n for n in NODE_NAMES.values() if n not in found]
        if missing or slurm.CONTROLLER not in bed.hosts:
            raise SystemExit(f"relay demo --launcher slurm: expected a Slurm test bed with hosts "
                             f"{', '.join(NODE_NAMES.values())}; found {', '.join(found)}. "
                             "`relay testbed down`, then `relay testbed up --nodes 5`, or "
                             "neither (the demo brings its own bed up)")
        print(f"  Slurm test bed {bed.name} (already up): {', '.join(found)}", flush=True)
        yield bed
        return
    why = slurm.can_run_slurm()
    if why:
        raise SystemExit(f"relay demo --launcher slurm: the test bed cannot run here: {why}")
    print("  waiting for the machine's test-bed lease (another bed may be up)...", flush=True)
    with lease():
        bed = slurm.up(NODES, timeout=60.0, hide=[str(home)])
        try:
            print(f"  Slurm test bed {bed.name} up: slurmctld on {slurm.CONTROLLER}, slurmd on "
                  f"{', '.join(NODE_NAMES.values())} (RELAY_HOME hidden in each)", flush=True)
            yield bed
        finally:
            hosts.down(bed)
            print(f"  Slurm test bed {bed.name} down", flush=True)


@contextlib.contextmanager
def on_slurm(home: Path, local_spec: Path) -> Iterator[Path]:
    """Bring up (or find) the bed and an MLflow server on its bridge, point this process's
    environment at them; yield the demo's Slurm spec. Everything is stopped at the end."""
    from relay.tools.mlflow_server import mlflow_server
    from relay.tools.testbed.hosts import ROOT_ADDRESS, ROOT_NAME
    from relay.tools.testbed.slurm import slurm_env
    from relay_train.protocol.env import ENV_TRACKING_URI

    folder = home / "slurm-demo"
    store = folder / "mlflow"
    store.mkdir(parents=True, exist_ok=True)
    with bed_for_demo(home) as bed, \
            mlflow_server(store, host=ROOT_ADDRESS,
                          allowed_hosts=f"{ROOT_ADDRESS}:*,{ROOT_NAME}:*") as url:
        print(f"  MLflow server {url} (root namespace, on the bridge; store {store})",
              flush=True)
        spec = slurm_spec(local_spec, bed, folder / "jobs")
        changes = {ENV_TRACKING_URI: url, "RELAY_NODES": ",".join(NODE_NAMES.values()),
                   "RELAY_JOBS_DIR": str(spec.parent), **slurm_env(bed)}
        before = {k: os.environ.get(k) for k in changes}
        os.environ.update(changes)
        try:
            yield spec
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
