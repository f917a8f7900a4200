"""A short segment (issue 29 item 2): the policy, the classification and the rank's own check.

A rank whose script returns cleanly before its segment's end is a ``short_segment``
fault, never a success: the policy refuses any rule that would retry it (at the rule's
file:line), the shipped policies stop the segment, the watcher tells it from a crash only
by the worker's exit code *and* its message, and a rank's session knows when it ended
early (a drain or the segment's end is not early), and a drained rank checkpoints the
drain's step however late the drain came. The real multi-process run is in
``test_short_segment_run.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from policy_files import line_of, load_error

import relay.core.settings
from relay.core.attempt import AttemptState
from relay.core.faults import Fault, FaultKind
from relay.launchers.base import LaunchStatus, NodeStatus
from relay.policy.decide import decide
from relay.policy.explain import explain
from relay.policy.model import load_policy
from relay.watch.exits import classify_exit
from relay_train.api import Session
from relay_train.protocol.launch import (
    DRAIN_FILE,
    SHORT_SEGMENT_EXIT,
    LaunchConfig,
    parse_short_segment,
    short_segment_message,
)
from relay_train.protocol.routes import NodeState

REPO = Path(relay.core.settings.REPO_ROOT)
RULES = """\
version: 1
rules:
  hang:                {action: restart_elsewhere, quarantine: 30m}
  rank_unresponsive:   {action: restart_elsewhere, quarantine: 30m}
  node_unresponsive:   {action: restart_elsewhere, quarantine: 1h}
  straggler:           {action: checkpoint_and_migrate, quarantine: 30m}
  throughput_degraded: {action: checkpoint_and_migrate}
  crash:               {action: retry}
  launch_failure:      {action: restart_elsewhere, quarantine: 15m}
  nan_loss:            {action: rollback}
  corrupt_checkpoint:  {action: rollback}
  short_segment:       RULE
"""


def _policy(tmp_path: Path, rule: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(RULES.replace("RULE", rule))
    return path


# -- the policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", [
    "{action: restart_elsewhere, quarantine: 30m}",
    "{action: restart_elsewhere}",
    "{action: retry}",
    "{action: rollback}",
    "{action: checkpoint_and_migrate, quarantine: 30m}",
])
def test_a_rule_that_retries_a_short_segment_is_refused_at_its_line(
    tmp_path: Path, rule: str
) -> None:
    path = _policy(tmp_path, rule)
    error = load_error(path)
    text = str(error)

    assert len(error.problems) == 1, text
    problem = error.problems[0]
    assert problem.field == "rules.short_segment"
    assert problem.line == line_of(path, "short_segment")
    assert f"{path}:{problem.line}: rules.short_segment: expected abort or escalate" in text
    assert "a retry would end the same way" in problem.fix
    assert "action: abort" in problem.fix


def test_a_policy_written_before_the_kind_existed_loads_and_aborts_it(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(RULES.replace("  short_segment:       RULE\n", ""))
    loaded = load_policy(path)
    fault = Fault(FaultKind.SHORT_SEGMENT, 1, "node-b", {"summary": "x"})
    decision = decide(fault, [], loaded.policy, loaded.sha256)
    assert (decision.action, decision.retry) == ("abort", False)


@pytest.mark.parametrize("rule", ["{action: abort}", "{action: escalate}",
                                  "{action: escalate, escalate_to: ml-research-leads}"])
def test_abort_and_escalate_are_accepted_and_never_retry(tmp_path: Path, rule: str) -> None:
    loaded = load_policy(_policy(tmp_path, rule))
    fault = Fault(FaultKind.SHORT_SEGMENT, 1, "node-b", {"summary": "x"})
    decision = decide(fault, [], loaded.policy, loaded.sha256)
    assert decision.retry is False
    assert decision.action in ("abort", "escalate")
    assert decision.quarantine_node is None


def test_the_shipped_policies_stop_the_segment() -> None:
    default = load_policy(REPO / "policies" / "default.yaml")
    fault = Fault(FaultKind.SHORT_SEGMENT, 1, "node-b", {"summary": "x"})
    decision = decide(fault, [], default.policy, default.sha256)
    assert (decision.action, decision.retry) == ("abort", False)
    assert decision.reason == "rules.short_segment says abort: stop the segment for good"
    assert "(short_segment)" in explain(default)
    strict = load_policy(REPO / "policies" / "strict.yaml")
    assert decide(fault, [], strict.policy, strict.sha256).action == "escalate"


# -- telling it from a crash -------------------------------------------------------------------


def _failed(rank: int, code: int, log: str) -> LaunchStatus:
    """Node-b's rank ``rank`` ended with ``code`` and ``log``; node-a's rank 0 was stopped."""
    return LaunchStatus(AttemptState.FAILED, {
        "node-a": NodeStatus("node-a", NodeState.FAILED, {0: -15}),
        "node-b": NodeStatus("node-b", NodeState.FAILED, {rank: code}, errors={rank: log}),
    })


def test_the_exit_code_with_its_message_is_a_short_segment_naming_rank_and_steps() -> None:
    log = "INFO some training line\n" + short_segment_message(1, 306, 340, 4) + "\n"
    fault = classify_exit(_failed(1, SHORT_SEGMENT_EXIT, log), {"node-a": [0], "node-b": [1]})
    assert fault is not None
    assert (fault.kind, fault.culprit_rank, fault.culprit_node) == (
        FaultKind.SHORT_SEGMENT, 1, "node-b")
    assert (fault.evidence["step"], fault.evidence["expected_step"]) == (306, 340)
    summary = fault.evidence["summary"]
    assert "rank 1's script returned cleanly at step 306" in summary
    assert "expected it to train to step 340" in summary
    assert fault.describe().startswith("short_segment (node node-b, rank 1): rank 1's script")


@pytest.mark.parametrize(("code", "log"), [
    (SHORT_SEGMENT_EXIT, "Traceback ...\nSystemExit: the script's own exit code 78\n"),
    (2, short_segment_message(1, 306, 340, 4)),  # the message alone proves nothing either
    (SHORT_SEGMENT_EXIT, short_segment_message(3, 306, 340, 4)),  # another rank's line
])
def test_anything_less_is_still_a_crash(code: int, log: str) -> None:
    fault = classify_exit(_failed(1, code, log), {"node-a": [0], "node-b": [1]})
    assert fault is not None and fault.kind is FaultKind.CRASH
    assert fault.culprit_rank == 1


def test_the_message_round_trips() -> None:
    text = short_segment_message(7, 12, 60, 0)
    assert parse_short_segment("a\n" + text + "\nb") == (7, 12, 60)
    assert "session.steps()" in text and "segment 0" in text
    assert parse_short_segment("rank 7 exited with code 78") is None


# -- the rank's own check (a real Session, in this process) ---------------------------------------


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    """Rank 1 of a 2-rank attempt of steps [4, 10) of a 40-step job (no process group)."""
    cfg = LaunchConfig(
        job="short", seed=1, model={}, data={}, optimizer={}, start_step=4, end_step=10,
        checkpoint_every=10**9, nodes=["node-a", "node-b"], ranks_per_node=1,
        tracking_uri="", run_id="r", attempt_dir=str(tmp_path), attempt=1, segment=1,
        backend="gloo", deterministic=False, total_steps=40)  # torch's global flags untouched
    made = Session(cfg, 1, "node-b")
    yield made
    made.close()


def _train(session: Session, until: int | None = None) -> None:
    for step in session.steps():
        session.report(step)
        if until is not None and step + 1 == until:
            return


def test_a_loop_that_breaks_early_is_short(session: Session) -> None:
    assert (session.start_step, session.end_step, session.total_steps) == (4, 10, 40)
    _train(session, until=7)
    assert session.shortfall() == (7, 10, 1)


def test_the_whole_segment_is_not_short(session: Session) -> None:
    _train(session)
    assert session.shortfall() is None


def test_a_drained_rank_is_not_short(session: Session) -> None:
    (session.cfg.root / DRAIN_FILE).write_text(json.dumps({"stop_at": 6}))
    _train(session)
    assert session._last_step == 6
    assert session.shortfall() is None


def _train_drained(session: Session, asked_after: int, stop_at: int) -> list[int]:
    """Train until drained at ``stop_at``, the drain asked once step ``asked_after`` is
    reported; return the steps saved."""
    session.track(lambda: {"w": torch.zeros(1)})
    saved: list[int] = []

    def save(step: int, state: object = None) -> float:
        saved.append(step)
        session._saved_at = step
        return 0.0

    session.save = save  # type: ignore[method-assign]
    for step in session.steps():
        session.report(step)
        if step == asked_after:
            (session.cfg.root / DRAIN_FILE).write_text(json.dumps({"stop_at": stop_at}))
    assert session._last_step == stop_at
    return saved


@pytest.mark.parametrize("asked_after", [5, 4])
def test_the_drains_step_is_checkpointed_once_whenever_the_drain_came(
        session: Session, asked_after: int) -> None:
    """Asked after the report of the step before the drain's (5), the loop's next turn
    saves it; asked a step earlier (4), that report saves it, and it is not saved twice."""
    assert _train_drained(session, asked_after, 6) == [6]


def test_a_script_with_its_own_loop_is_judged_by_the_steps_it_reported(
    session: Session
) -> None:
    for step in range(session.start_step, session.end_step - 1):
        session.report(step)
    assert session.shortfall() == (9, 10, 1)
    session.report(session.end_step - 1)
    assert session.shortfall() is None


def test_total_steps_falls_back_to_the_last_segment_end_known(tmp_path: Path) -> None:
    cfg = LaunchConfig(
        job="short", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=10,
        checkpoint_every=5, nodes=["node-a"], ranks_per_node=1, tracking_uri="", run_id="r",
        attempt_dir=str(tmp_path), attempt=1, segment=0, boundaries=[10, 20, 30])
    assert cfg.job_steps == 30  # a launch file from before total_steps was written
    assert cfg.rank_environment("node-a", 0)["RELAY_TOTAL_STEPS"] == "30"
