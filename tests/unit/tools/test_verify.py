"""`relay verify`: which fault it injects, what it refuses, how it reads two checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relay.core.settings import REPO_ROOT
from relay.spec.job import load_job_spec
from relay.tools.cli import build_parser
from relay.tools.verify import check_fault, default_fault, spec_path, verdict

DEMO = REPO_ROOT / "dags" / "jobs" / "demo.yaml"


def test_by_default_the_last_rank_hangs_half_way_through_the_middle_segment() -> None:
    spec = load_job_spec(DEMO)  # 240 steps, segments of 60, 4 ranks
    assert default_fault(spec) == {"kind": "hang", "segment": 2, "step": 150, "attempt": 1,
                                   "rank": 3}
    assert default_fault(spec, "crash", rank=1, step=75) == {
        "kind": "crash", "segment": 1, "step": 75, "attempt": 1, "rank": 1}
    assert default_fault(spec, "stop_node", node="node-b")["node"] == "node-b"
    assert check_fault(spec, DEMO, default_fault(spec)) is None


def test_faults_it_cannot_inject_are_refused_with_the_fix(tmp_path: Path) -> None:
    spec = load_job_spec(DEMO)
    assert "expected --node NAME" in str(check_fault(spec, DEMO, default_fault(spec, "stop_node")))
    assert "expected a step from 0 to 239" in str(
        check_fault(spec, DEMO, {**default_fault(spec), "step": 240}))
    forbidden = tmp_path / "job.yaml"
    forbidden.write_text(DEMO.read_text().replace("chaos: allowed", ""))
    problem = check_fault(load_job_spec(forbidden), forbidden, default_fault(spec))
    assert problem is not None and "chaos: allowed" in problem and str(forbidden) in problem


def test_a_job_is_named_by_its_file_or_its_name(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    assert spec_path(str(DEMO)) == DEMO
    monkeypatch.setenv("RELAY_JOBS_DIR", str(DEMO.parent))
    assert spec_path("demo") == DEMO
    assert spec_path("no-such-job") is None
    args = build_parser().parse_args(["verify", "demo", "--fault", "crash", "--rank", "2"])
    assert (args.job, args.fault, args.rank) == ("demo", "crash", 2)


def test_the_verdict_names_the_first_differing_tensor() -> None:
    def final() -> dict:
        return {"step": 240, "model": {"w": torch.zeros(3)}, "optimizer": {"state": {}},
                "rng": {"torch": torch.zeros(2, dtype=torch.uint8),
                        "ranks": {"0": {}, "1": {}}}}

    exact, lines = verdict(final(), final())
    assert exact and lines == ["bit-exact: step 240, 1 tensors (model, optimizer) identical",
                               "  (RNG states saved for 2 and 2 ranks; not compared)"]
    other = final()
    other["model"]["w"][2] = 1.0
    exact, lines = verdict(final(), other)
    assert not exact and lines == [
        "NOT bit-exact. First difference at model.w[2]: 0.0 (fault-free) vs 1.0 (with the fault)"]
    other = final()
    other["rng"]["torch"][1] = 7  # a generator never seeded differs between any two runs
    assert verdict(final(), other)[0]
