"""Every rank stalled in turn, under DDP with buffers, FSDP2 (in its forward and in its
backward) and a user's metric all_reduce:
the culprit Relay acts on is the stalled rank every time.

Real gloo ranks (:mod:`culprit_worker`), Relay's real detector on their heartbeats,
their real stacks and Flight Recorder traces (:mod:`culprit_bench`). 28-36 s a case here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from culprit_bench import run_case

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # `make test-slow`

CASES = [("ddp_buffers", 3, s) for s in range(3)] + [
    (model, 2, s) for model in ("fsdp2", "fsdp2_backward", "metric") for s in range(2)]


@pytest.mark.parametrize(("model", "world", "stalled"), CASES)
def test_the_stalled_rank_is_the_culprit(model: str, world: int, stalled: int,
                                         tmp_path: Path) -> None:
    result = run_case(model, world, stalled, marked=True, folder=tmp_path)
    assert result.culprit == stalled, result
    if model == "metric":  # the user's all_reduce is unmarked: only the evidence names it
        assert result.heartbeat_culprit is None, result
        assert "the evidence names rank" in result.note, result
    else:  # mark_collectives: the phases already name it, and the stacks confirm it
        assert result.heartbeat_culprit == stalled, result
        assert result.note.startswith(f"rank {stalled} confirmed by its stack"), result


@pytest.mark.parametrize("stalled", [0, 1])
def test_without_marks_the_evidence_still_names_the_stalled_rank(stalled: int,
                                                                 tmp_path: Path) -> None:
    # Issue 29's case: healthy ranks wait in DDP's buffer broadcast marked "compute".
    result = run_case("ddp_buffers", 2, stalled, marked=False, folder=tmp_path)
    assert result.heartbeat_culprit is None, result
    assert result.culprit == stalled, result
