"""`relay verify` end to end on the built-in job: a fault-free run, a run where a rank
hangs, and the verdict read from their final checkpoints (Airflow, MLflow, 4-rank DDP)."""

from __future__ import annotations

from pathlib import Path

import pytest
from airflow_jobs import free_the_pool

from relay.nodes.pool import NodePool
from relay.tools import verify

pytestmark = pytest.mark.integration

BUILTIN = """\
job: verified
seed: 7
total_steps: 60
steps_per_segment: 30
checkpoint_every: 10
nodes: 2
ranks_per_node: 2
model: {context: 32, d_model: 32, n_layers: 1, n_heads: 2, dropout: 0.1}
data: {batch_size: 8}
retries: 2
retry_delay: 1s
chaos: allowed
"""


@pytest.mark.slow  # `make test-slow`: two DAG runs through Airflow
def test_verify_the_builtin_job_with_a_hung_rank_is_bit_exact(
    relay_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = tmp_path / "verified.yaml"
    spec.write_text(BUILTIN)
    monkeypatch.setenv("RELAY_JOBS_DIR", str(tmp_path))  # verify points it there; undone after
    free_the_pool()
    code = verify.main(spec)
    out = capsys.readouterr().out
    assert code == 0, out
    assert '"kind": "hang", "segment": 1, "step": 45, "attempt": 1, "rank": 3' in out
    assert "hang" in out.split("with the fault:")[-1]  # the fault table names the hang
    assert "bit-exact: step 60" in out, out
    assert "RNG states saved for 4 and 4 ranks" in out, out  # every rank's, gathered at rank 0
    assert NodePool().quarantines() == {}  # the quarantine the hang caused was lifted
