"""`relay demo --launcher slurm`'s job and faults: the local demo's, named as on the test bed
(no Slurm needed here; tests/testbed/test_slurm_demo.py runs it)."""

from __future__ import annotations

from pathlib import Path

from relay.core import settings
from relay.spec.job import load_job_spec
from relay.tools.demo import DEMO_FAULTS
from relay.tools.demo_slurm import JOB, SLURM_STRAGGLER_FACTOR, slurm_faults, slurm_spec
from relay.tools.testbed import TestBed


def test_the_slurm_demo_runs_the_local_demos_job_and_faults_on_the_beds_nodes(
        tmp_path: Path) -> None:
    local = load_job_spec(settings.jobs_dir() / "demo.yaml")
    bed = TestBed("rlyabc123", str(tmp_path / "bed"))
    spec = load_job_spec(slurm_spec(settings.jobs_dir() / "demo.yaml", bed, tmp_path / "jobs"))
    assert (spec.job, spec.launcher) == (JOB, "slurm")
    assert spec.slurm is not None
    assert spec.slurm.node_home == f"{bed.folder}/hosts/{{node}}/attempts"
    same = ("seed", "total_steps", "steps_per_segment", "checkpoint_every", "nodes",
            "ranks_per_node", "model", "data", "optimizer", "policy")
    assert {k: getattr(spec, k) for k in same} == {k: getattr(local, k) for k in same}

    faults = slurm_faults(DEMO_FAULTS)
    assert [f["chaos"].get("node") for f in faults] == [None, "node2", "node4"]
    assert [{k: v for k, v in f["chaos"].items() if k not in ("node", "factor")}
            for f in faults] == \
        [{k: v for k, v in f["chaos"].items() if k not in ("node", "factor")}
         for f in DEMO_FAULTS]
    straggler = faults[2]["chaos"]["factor"]
    assert straggler == SLURM_STRAGGLER_FACTOR > DEMO_FAULTS[2]["chaos"]["factor"]
    assert f"{SLURM_STRAGGLER_FACTOR:g}x slower" in faults[2]["what"]
    assert "node2" in faults[1]["what"] and "node-b" not in faults[1]["what"]
