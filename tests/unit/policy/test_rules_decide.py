"""Unit tests for the policy's recovery rules, the decision engine, PolicyRetry and explain."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from airflow.sdk.definitions.retry_policy import RetryAction
from policy_files import line_of, load_error

import relay.core.settings
from relay.core.faults import Fault, FaultKind
from relay.operators.retry import PolicyRetry, SegmentFaultError
from relay.policy.decide import Decision, decide, ordinal
from relay.policy.explain import explain, humanize
from relay.policy.model import Policy, load_policy
from relay.policy.rules import Action, Backoff
from relay.tools.cli import main, policy_schema_text

REPO = Path(relay.core.settings.REPO_ROOT)
DEFAULT = REPO / "policies" / "default.yaml"
STRICT = REPO / "policies" / "strict.yaml"
SCHEMA = REPO / "policies" / "schema.json"
SHA = "ab" * 32
KINDS = list(FaultKind)
ALL_ACTIONS = [a.value for a in Action]
# Kinds whose fault names a culprit node (everything but the job-wide ones).
CULPRIT_KINDS = [k for k in KINDS
                 if k not in (FaultKind.THROUGHPUT_DEGRADED, FaultKind.CORRUPT_CHECKPOINT)]
NO_CHECKPOINT_KINDS = [k for k in KINDS if k not in (
    FaultKind.STRAGGLER, FaultKind.THROUGHPUT_DEGRADED, FaultKind.PREEMPTED)]

# A valid rule for every kind, as YAML flow mappings (one line each, so each has its own line).
_RESTART = "{action: restart_elsewhere, max_attempts: 3, backoff: 1s, quarantine: %s}"
BASE_YAML = {
    "hang": _RESTART % "30m",
    "rank_unresponsive": _RESTART % "30m",
    "node_unresponsive": _RESTART % "1h",
    "straggler": "{action: checkpoint_and_migrate, max_attempts: 3, quarantine: 30m}",
    "throughput_degraded": "{action: checkpoint_and_migrate, max_attempts: 2}",
    "crash": "{action: retry, max_attempts: 3, backoff: {initial: 1s, multiplier: 2, max: 30s}}",
    "launch_failure": "{action: restart_elsewhere, max_attempts: 2, backoff: 5s, quarantine: 15m}",
    "nan_loss": "{action: rollback, max_attempts: 2}",
    "corrupt_checkpoint": "{action: rollback, max_attempts: 2}",
    "short_segment": "{action: abort}",
    "preempted": "{action: checkpoint_and_migrate, max_attempts: 5}",
}

# The same as Python data, for Policy.model_validate.
BASE_RULES: dict[str, dict[str, Any]] = {k: yaml.safe_load(v) for k, v in BASE_YAML.items()}


# -- helpers ----------------------------------------------------------------------------


def write_rules(tmp_path: Path, **overrides: str | None) -> Path:
    """Write a policy whose rules are BASE_YAML with ``overrides`` (None drops the kind)."""
    rules = {**BASE_YAML, **overrides}
    body = "".join(f"  {kind}: {flow}\n" for kind, flow in rules.items() if flow is not None)
    path = tmp_path / "policy.yaml"
    path.write_text(f"# governance-owned\nversion: 1\nrules:\n{body}max_attempts_per_segment: 8\n")
    return path


def make_policy(rules: dict[str, dict[str, Any]] | None = None, **top: Any) -> Policy:
    """Build a Policy in code: BASE_RULES with per-kind ``rules`` replaced, plus top-level keys."""
    return Policy.model_validate({"rules": {**BASE_RULES, **(rules or {})}, **top})


def fault(kind: FaultKind, node: str | None = "node-b", rank: int | None = 3) -> Fault:
    return Fault(kind=kind, culprit_rank=rank, culprit_node=node,
                 evidence={"summary": "test"}, detected_at=1000.0)


def culprit_fault(kind: FaultKind) -> Fault:
    """A fault as detection would report it: job-wide kinds have no culprit."""
    if kind in CULPRIT_KINDS:
        return fault(kind)
    return fault(kind, node=None, rank=None)


# -- rules validation through load_policy -------------------------------------------------


def test_base_rules_cover_every_kind() -> None:
    assert set(BASE_YAML) == {k.value for k in KINDS}


def test_base_rules_yaml_loads(tmp_path: Path) -> None:
    rules = load_policy(write_rules(tmp_path)).policy.rules
    assert rules.hang.quarantine == 1800.0
    assert rules.crash.backoff == Backoff(initial=1.0, multiplier=2.0, max=30.0)


@pytest.mark.parametrize("kind", [k.value for k in KINDS
                                  if k not in (FaultKind.SHORT_SEGMENT, FaultKind.PREEMPTED)])
def test_missing_rule_for_a_kind_names_it_with_a_fix(tmp_path: Path, kind: str) -> None:
    path = write_rules(tmp_path, **{kind: None})
    error = load_error(path)
    text = str(error)

    assert [p.field for p in error.problems] == [f"rules.{kind}"]
    problem = error.problems[0]
    assert problem.line == line_of(path, "rules")
    assert f"{path}:{problem.line}: rules.{kind}: expected this field to be set" in text
    assert "Fix: " in text and f"e.g. {kind}: {{action:" in problem.fix


@pytest.mark.parametrize("kind", ["hang", "crash", "nan_loss"])
def test_unknown_action_lists_the_allowed_ones(tmp_path: Path, kind: str) -> None:
    path = write_rules(tmp_path, **{kind: "{action: reboot, quarantine: 30m}"})
    error = load_error(path)
    text = str(error)

    assert len(error.problems) == 1, text
    problem = error.problems[0]
    assert problem.field == f"rules.{kind}.action"
    assert problem.line == line_of(path, kind)
    assert f"{path}:{problem.line}: rules.{kind}.action: expected one of" in text
    assert "'reboot'" in text
    for action in ALL_ACTIONS:
        assert f"'{action}'" in problem.expected
    assert "Fix: " in text and "one of" in problem.fix


# Cross-rule checks (Rules._action_fits_fault): (kind, flow, words that must be in the text).
REJECTED_COMBINATIONS = [
    *[
        pytest.param(
            k.value, "{action: checkpoint_and_migrate, quarantine: 30m}",
            [f"rules.{k.value}: expected an action that works without every rank alive",
             f"a {k.value} fault leaves a rank unable to take part in a checkpoint",
             "use action: restart_elsewhere"],
            id=f"checkpoint_and_migrate-on-{k.value}",
        )
        for k in NO_CHECKPOINT_KINDS
        if k not in (FaultKind.CORRUPT_CHECKPOINT, FaultKind.SHORT_SEGMENT)
    ],
    *[
        pytest.param(
            k.value, "{action: restart_elsewhere}",
            [f"rules.{k.value}: expected a quarantine duration",
             "restart_elsewhere keeps the culprit's node out", "say for how long",
             "quarantine: 30m"],
            id=f"restart_elsewhere-without-quarantine-on-{k.value}",
        )
        for k in CULPRIT_KINDS if k not in (FaultKind.SHORT_SEGMENT, FaultKind.PREEMPTED)
    ],
    *[
        pytest.param("preempted", flow,
                     ["rules.preempted: expected no quarantine", "a preempted node is healthy",
                      "Remove quarantine"], id=f"quarantine-on-preempted-{action}")
        for action, flow in [
            ("checkpoint_and_migrate", "{action: checkpoint_and_migrate, quarantine: 30m}"),
            ("restart_elsewhere", "{action: restart_elsewhere, quarantine: 30m}")]
    ],
    pytest.param("straggler", "{action: checkpoint_and_migrate}",
                 ["rules.straggler: expected a quarantine duration",
                  "checkpoint_and_migrate keeps the culprit's node out", "quarantine: 30m"],
                 id="checkpoint_and_migrate-without-quarantine-on-straggler"),
    pytest.param("throughput_degraded", "{action: checkpoint_and_migrate, quarantine: 30m}",
                 ["rules.throughput_degraded: expected no quarantine",
                  "a throughput_degraded fault names no culprit node", "remove quarantine"],
                 id="quarantine-on-throughput_degraded"),
    pytest.param("throughput_degraded", "{action: retry, quarantine: 10m}",
                 ["names no culprit node"], id="quarantine-on-throughput_degraded-retry"),
    pytest.param("crash", "{action: retry, quarantine: 10m}",
                 ["rules.crash: expected no quarantine", "retry does not move the job",
                  "use action: restart_elsewhere"], id="quarantine-on-retry"),
    pytest.param("corrupt_checkpoint", "{action: rollback, quarantine: 30m}",
                 ["rules.corrupt_checkpoint: expected no quarantine",
                  "a corrupt_checkpoint fault names no culprit node", "remove quarantine"],
                 id="quarantine-on-corrupt_checkpoint"),
    pytest.param("corrupt_checkpoint", "{action: restart_elsewhere}",
                 ["rules.corrupt_checkpoint: expected rollback, escalate or abort",
                  "a corrupt checkpoint is not a node's fault", "use action: rollback"],
                 id="restart_elsewhere-on-corrupt_checkpoint"),
    pytest.param("corrupt_checkpoint", "{action: checkpoint_and_migrate}",
                 ["a corrupt checkpoint is not a node's fault"],
                 id="checkpoint_and_migrate-on-corrupt_checkpoint"),
]


@pytest.mark.parametrize(("kind", "flow", "words"), REJECTED_COMBINATIONS)
def test_rules_that_do_not_fit_their_fault_are_rejected(
    tmp_path: Path, kind: str, flow: str, words: list[str]
) -> None:
    path = write_rules(tmp_path, **{kind: flow})
    error = load_error(path)
    text = str(error)

    assert error.file == str(path)
    assert len(error.problems) == 1, text
    problem = error.problems[0]
    # file:line is given: the line of the rule that is wrong.
    assert problem.line is not None
    assert f"{path}:{problem.line}: rules" in text
    assert f"rules.{kind}" in text  # the rule that is wrong is named
    for word in words:
        assert word in text, f"{word!r} not in {text!r}"
    assert "Fix: " in text


def test_every_misfit_rule_is_reported_at_once(tmp_path: Path) -> None:
    path = write_rules(
        tmp_path,
        hang="{action: checkpoint_and_migrate, quarantine: 30m}",
        crash="{action: restart_elsewhere}",
        corrupt_checkpoint="{action: rollback, quarantine: 1h}",
    )
    error = load_error(path)
    text = str(error)
    assert len(error.problems) == 3, text
    assert "rules.hang: expected an action that works without every rank alive" in text
    assert "rules.crash: expected a quarantine duration" in text
    assert "rules.corrupt_checkpoint: expected no quarantine" in text


def test_misfit_rule_is_reported_at_its_own_line_and_field(tmp_path: Path) -> None:
    path = write_rules(tmp_path, hang="{action: checkpoint_and_migrate, quarantine: 30m}",
                       crash="{action: restart_elsewhere}")
    error = load_error(path)
    got = {p.field: p.line for p in error.problems}
    assert got == {"rules.hang": line_of(path, "hang"), "rules.crash": line_of(path, "crash")}
    for problem in error.problems:
        assert not problem.fix.startswith("set rules to")


ACCEPTED_COMBINATIONS = [
    ("straggler", "{action: checkpoint_and_migrate, quarantine: 30m}"),
    ("throughput_degraded", "{action: checkpoint_and_migrate}"),
    ("throughput_degraded", "{action: restart_elsewhere}"),  # no culprit: nothing to quarantine
    ("crash", "{action: retry}"),
    ("crash", "{action: restart_elsewhere, quarantine: 0s}"),
    ("crash", "{action: retry}"),
    ("nan_loss", "{action: abort}"),
    ("corrupt_checkpoint", "{action: escalate, escalate_to: ml-research-leads}"),
    ("hang", "{action: escalate}"),
    ("hang", "{action: rollback, max_attempts: 1}"),
]


@pytest.mark.parametrize(("kind", "flow"), ACCEPTED_COMBINATIONS)
def test_rules_that_fit_their_fault_load(tmp_path: Path, kind: str, flow: str) -> None:
    rule = load_policy(write_rules(tmp_path, **{kind: flow})).policy.rules.for_kind(FaultKind(kind))
    assert rule.action.value == yaml.safe_load(flow)["action"]


BAD_FIELDS = [
    pytest.param("crash", "{action: retry, backoff: {initial: 1s, multiplier: 0.5}}",
                 "rules.crash.backoff.multiplier", [">= 1", "0.5"], id="multiplier-below-1"),
    pytest.param("hang", "{action: restart_elsewhere, quarantine: -5m}",
                 "rules.hang.quarantine", ["not negative", "'-5m'"], id="negative-quarantine"),
    pytest.param("hang", "{action: restart_elsewhere, quarantine: -60}",
                 "rules.hang.quarantine", ["not negative"], id="negative-quarantine-number"),
    pytest.param("crash", "{action: retry, backoff: -5s}",
                 "rules.crash.backoff.initial", ["not negative", "'-5s'"], id="negative-backoff"),
    pytest.param("crash", "{action: retry, backoff: soon}",
                 "rules.crash.backoff.initial", ["a duration such as", "'soon'"],
                 id="unparseable-backoff"),
    pytest.param("crash", "{action: retry, max_attempts: 0}",
                 "rules.crash.max_attempts", [">= 1", "0"], id="zero-max-attempts"),
    pytest.param("crash", "{action: retry, max_attempts: '3'}",
                 "rules.crash.max_attempts", ["a whole number"], id="text-max-attempts"),
    pytest.param("crash", "{action: retry, max_attempt: 3}",
                 "rules.crash.max_attempt", ["no such field"], id="misspelt-field"),
]


@pytest.mark.parametrize(("kind", "flow", "field", "words"), BAD_FIELDS)
def test_bad_rule_field_names_file_line_and_fix(
    tmp_path: Path, kind: str, flow: str, field: str, words: list[str]
) -> None:
    path = write_rules(tmp_path, **{kind: flow})
    error = load_error(path)
    text = str(error)

    assert len(error.problems) == 1, text
    problem = error.problems[0]
    assert problem.field == field
    assert problem.line == line_of(path, kind)
    assert f"{path}:{problem.line}: {field}: expected" in text
    for word in words:
        assert word in text, f"{word!r} not in {text!r}"
    assert "Fix: " in text and problem.fix


@pytest.mark.parametrize(("shorthand", "full"), [
    ("5s", "{initial: 5s}"),
    ("5", "{initial: 5s}"),
    ("1m30s", "{initial: 90s}"),
    ("0s", "{}"),
])
def test_backoff_shorthand_means_initial(tmp_path: Path, shorthand: str, full: str) -> None:
    short = load_policy(write_rules(tmp_path, crash=f"{{action: retry, backoff: {shorthand}}}"))
    longer = load_policy(write_rules(tmp_path, crash=f"{{action: retry, backoff: {full}}}"))
    assert short.policy.rules.crash.backoff == longer.policy.rules.crash.backoff
    backoff = short.policy.rules.crash.backoff
    assert (backoff.multiplier, backoff.max) == (1.0, 3600.0)


def test_backoff_shorthand_in_code() -> None:
    rules = make_policy({"crash": {"action": "retry", "backoff": "5s"}}).rules
    assert rules.crash.backoff == Backoff(initial=5.0)


# -- Backoff.seconds ----------------------------------------------------------------------


@pytest.mark.parametrize(("backoff", "expected"), [
    (Backoff(), [0.0, 0.0, 0.0]),
    (Backoff(initial=5), [5.0, 5.0, 5.0, 5.0]),
    (Backoff(initial=1, multiplier=2, max=30), [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]),
    (Backoff(initial=10, multiplier=3, max=300), [10.0, 30.0, 90.0, 270.0, 300.0]),
    (Backoff(initial=0.5, multiplier=1.5, max=1), [0.5, 0.75, 1.0, 1.0]),
    (Backoff(initial=100, max=10), [10.0, 10.0]),  # max caps even the first wait
])
def test_backoff_seconds_grows_geometrically_up_to_max(
    backoff: Backoff, expected: list[float]
) -> None:
    got = [backoff.seconds(repeat) for repeat in range(1, len(expected) + 1)]
    assert got == pytest.approx(expected)
    for repeat, value in enumerate(got, start=1):
        raw = backoff.initial * backoff.multiplier ** (repeat - 1)
        assert value == pytest.approx(min(backoff.max, raw))


def test_backoff_seconds_stays_capped_for_huge_repeats() -> None:
    assert Backoff(initial=1, multiplier=2, max=60).seconds(1100) == 60.0


# -- decide: every action ------------------------------------------------------------------


def _actions_for(kind: FaultKind) -> list[dict[str, Any]]:
    """Every rule (action) that may be written for ``kind``, with a quarantine where needed."""
    rules: list[dict[str, Any]] = [
        {"action": "retry", "backoff": "7s"},
        {"action": "rollback", "backoff": "2s"},
        {"action": "escalate"},
        {"action": "escalate", "escalate_to": "ml-research-leads"},
        {"action": "abort"},
    ]
    if kind is FaultKind.SHORT_SEGMENT:  # never retried (test_short_segment_rules)
        return [r for r in rules if r["action"] in ("escalate", "abort")]
    if kind is not FaultKind.CORRUPT_CHECKPOINT:
        restart: dict[str, Any] = {"action": "restart_elsewhere", "backoff": "3s"}
        if kind in CULPRIT_KINDS and kind is not FaultKind.PREEMPTED:
            restart["quarantine"] = "45m"
        rules.append(restart)
    if kind in (FaultKind.STRAGGLER, FaultKind.THROUGHPUT_DEGRADED, FaultKind.PREEMPTED):
        migrate: dict[str, Any] = {"action": "checkpoint_and_migrate", "backoff": "4s"}
        if kind in CULPRIT_KINDS and kind is not FaultKind.PREEMPTED:
            migrate["quarantine"] = "2h"
        rules.append(migrate)
    return rules


EVERY_RULE = [
    pytest.param(kind, rule, id=f"{kind.value}-{rule['action']}"
                 + ("-to" if "escalate_to" in rule else ""))
    for kind in KINDS for rule in _actions_for(kind)
]


@pytest.mark.parametrize(("kind", "raw_rule"), EVERY_RULE)
def test_decide_follows_every_rule(kind: FaultKind, raw_rule: dict[str, Any]) -> None:
    policy = make_policy({kind.value: {"max_attempts": 3, **raw_rule}},
                         escalation={"target": "oncall"})
    rule = policy.rules.for_kind(kind)
    f = culprit_fault(kind)

    d = decide(f, [], policy, SHA)

    assert d.kind == kind.value
    assert d.rule == f"rules.{kind.value}"
    assert d.policy_sha256 == SHA
    assert (d.occurrence, d.max_attempts) == (1, 3)
    action = rule.action
    assert d.action == action.value
    if action in (Action.ESCALATE, Action.ABORT):
        assert d.retry is False
        assert d.backoff_seconds == 0.0
        assert d.quarantine_node is None and d.quarantine_seconds is None
        assert d.checkpoint_first is False and d.rollback is False
        if action is Action.ESCALATE:
            assert d.notify == (raw_rule.get("escalate_to") or "oncall")
            assert d.notify in d.reason
        else:
            assert d.notify is None
        assert f"rules.{kind.value} says {action.value}" in d.reason
        return
    assert d.retry is True
    assert d.notify is None
    assert d.backoff_seconds == rule.backoff.initial
    assert d.checkpoint_first is (action is Action.CHECKPOINT_AND_MIGRATE)
    assert d.rollback is (action is Action.ROLLBACK)
    if rule.quarantine is not None and f.culprit_node is not None:
        assert d.quarantine_node == f.culprit_node == "node-b"
        assert d.quarantine_seconds == rule.quarantine
    else:
        assert d.quarantine_node is None and d.quarantine_seconds is None
    moves = action in (Action.RESTART_ELSEWHERE, Action.CHECKPOINT_AND_MIGRATE)
    assert d.avoid_node == ("node-b" if moves and kind is FaultKind.PREEMPTED else None)
    assert d.reason.startswith(f"the 1st {kind.value} in this segment (limit 3): "
                               f"rules.{kind.value} says {action.value}")
    assert d.reason.endswith(f"in {rule.backoff.initial:g}s")


@pytest.mark.parametrize(("kind", "quarantine"), [
    (FaultKind.HANG, 1800.0), (FaultKind.RANK_UNRESPONSIVE, 1800.0),
    (FaultKind.NODE_UNRESPONSIVE, 3600.0), (FaultKind.LAUNCH_FAILURE, 900.0),
    (FaultKind.STRAGGLER, 1800.0),
])
def test_restart_like_actions_quarantine_the_culprit_node(
    kind: FaultKind, quarantine: float
) -> None:
    d = decide(fault(kind, node="node-c"), [], make_policy(), SHA)
    assert d.retry is True
    assert (d.quarantine_node, d.quarantine_seconds) == ("node-c", quarantine)
    assert "without node-c" in d.reason


@pytest.mark.parametrize("raw_rule", [
    {"action": "restart_elsewhere", "quarantine": "30m"},
    {"action": "restart_elsewhere", "quarantine": "30m", "backoff": "1s"},
])
def test_job_wide_fault_restarts_without_quarantine(raw_rule: dict[str, Any]) -> None:
    # A hang where no single rank is to blame is reported without a culprit.
    policy = make_policy({"hang": raw_rule})
    d = decide(fault(FaultKind.HANG, node=None, rank=None), [], policy, SHA)
    assert d.retry is True and d.action == "restart_elsewhere"
    assert d.quarantine_node is None and d.quarantine_seconds is None
    assert "without" not in d.reason


def test_job_wide_kinds_never_quarantine() -> None:
    policy = make_policy({"throughput_degraded": {"action": "restart_elsewhere"}})
    for kind in (FaultKind.THROUGHPUT_DEGRADED, FaultKind.CORRUPT_CHECKPOINT):
        d = decide(fault(kind, node=None, rank=None), [], policy, SHA)
        assert d.retry is True
        assert d.quarantine_node is None and d.quarantine_seconds is None


# -- decide: counting and limits -------------------------------------------------------------


@pytest.mark.parametrize(("history", "occurrence"), [
    ([], 1),
    ([FaultKind.HANG, FaultKind.STRAGGLER], 1),
    ([FaultKind.CRASH], 2),
    ([FaultKind.CRASH, FaultKind.HANG, FaultKind.CRASH], 3),
    ([FaultKind.NAN_LOSS, FaultKind.CRASH, FaultKind.HANG, FaultKind.CRASH, FaultKind.CRASH], 4),
])
def test_occurrence_counts_only_faults_of_the_same_kind(
    history: list[FaultKind], occurrence: int
) -> None:
    policy = make_policy({"crash": {"action": "retry", "max_attempts": 10}})
    d = decide(fault(FaultKind.CRASH), history, policy, SHA)
    assert d.occurrence == occurrence
    assert d.retry is True
    assert d.reason.startswith(f"the {ordinal(occurrence)} crash in this segment")


@pytest.mark.parametrize("max_attempts", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", [FaultKind.CRASH, FaultKind.HANG, FaultKind.NAN_LOSS])
def test_gives_up_exactly_when_occurrence_reaches_max_attempts(
    kind: FaultKind, max_attempts: int
) -> None:
    rule = {**BASE_RULES[kind.value], "max_attempts": max_attempts}
    policy = make_policy({kind.value: rule}, escalation={"target": "oncall"})
    names = {1: "1st", 2: "2nd", 3: "3rd", 4: "4th"}

    for occurrence in range(1, max_attempts + 1):
        history = [FaultKind.STRAGGLER] + [kind] * (occurrence - 1)  # others do not count
        d = decide(fault(kind), history, policy, SHA)
        assert d.occurrence == occurrence
        assert f"the {names[occurrence]} {kind.value} in this segment" in d.reason
        if occurrence < max_attempts:
            assert d.retry is True, d.reason
            assert d.action == rule["action"]
        else:
            assert d.retry is False, d.reason
            assert d.action == "escalate"
            assert d.notify == "oncall"
            assert d.quarantine_node is None and d.backoff_seconds == 0.0
            assert f"reaches rules.{kind.value}.max_attempts ({max_attempts})" in d.reason
            assert d.reason.endswith("stop and notify oncall")


def test_max_attempts_one_gives_up_on_the_first_fault() -> None:
    policy = make_policy({"launch_failure": {"action": "restart_elsewhere", "max_attempts": 1,
                                             "quarantine": "4h"}})
    d = decide(fault(FaultKind.LAUNCH_FAILURE), [], policy, SHA)
    assert (d.retry, d.action, d.occurrence) == (False, "escalate", 1)
    assert d.quarantine_node is None


def test_give_up_notifies_the_rules_own_escalation_target() -> None:
    policy = make_policy({"crash": {"action": "retry", "max_attempts": 2,
                                    "escalate_to": "ml-research-leads"}},
                         escalation={"target": "oncall"})
    assert decide(fault(FaultKind.CRASH), [], policy, SHA).notify is None
    d = decide(fault(FaultKind.CRASH), [FaultKind.CRASH], policy, SHA)
    assert (d.retry, d.notify) == (False, "ml-research-leads")


@pytest.mark.parametrize(("earlier", "retry"), [(0, True), (1, True), (2, False), (5, False)])
def test_max_attempts_per_segment_counts_every_kind(earlier: int, retry: bool) -> None:
    rules = {k.value: {"action": "retry", "max_attempts": 10} for k in KINDS
             if k is not FaultKind.SHORT_SEGMENT}
    policy = make_policy(rules, max_attempts_per_segment=3)
    cycle = [FaultKind.HANG, FaultKind.CRASH, FaultKind.NAN_LOSS]
    history = [cycle[i % 3] for i in range(earlier)]

    d = decide(fault(FaultKind.STRAGGLER), history, policy, SHA)

    assert d.occurrence == 1  # straggler itself is new...
    assert d.retry is retry  # ...but the segment has used up its attempts
    if not retry:
        assert d.action == "escalate"
        assert (f"attempt {earlier + 1} of this segment reaches max_attempts_per_segment (3)"
                in d.reason)


def test_backoff_grows_with_each_repeat_of_the_fault() -> None:
    policy = make_policy({"crash": {"action": "retry", "max_attempts": 8,
                                    "backoff": {"initial": "1s", "multiplier": 2, "max": "5s"}}})
    waits = []
    for repeat in range(1, 8):
        # interleave other faults: only repeats of crash grow the wait
        history = [FaultKind.CRASH] * (repeat - 1)
        d = decide(fault(FaultKind.CRASH), history, policy, SHA)
        waits.append(d.backoff_seconds)
        assert d.reason.endswith(f"in {d.backoff_seconds:g}s")
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0]
    other = decide(fault(FaultKind.CRASH), [FaultKind.HANG] * 5,
                   make_policy({"crash": BASE_RULES["crash"]}), SHA)
    assert other.backoff_seconds == 1.0


def test_decision_round_trips_as_json() -> None:
    d = decide(fault(FaultKind.HANG), [FaultKind.HANG], make_policy(), SHA)
    assert Decision.from_dict(json.loads(json.dumps(d.to_dict()))) == d


@pytest.mark.parametrize(("n", "text"), [(1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"),
                                         (10, "10th"), (11, "11th"), (12, "12th"), (13, "13th")])
def test_ordinal(n: int, text: str) -> None:
    assert ordinal(n) == text


def test_ordinal_above_twenty() -> None:
    assert [ordinal(n) for n in (21, 22, 23, 101, 111)] == ["21st", "22nd", "23rd", "101st",
                                                            "111th"]


# -- PolicyRetry -----------------------------------------------------------------------------


def test_policy_retry_retries_after_the_decided_backoff() -> None:
    policy = make_policy({"crash": {"action": "retry", "backoff": "1m30s"}})
    decision = decide(fault(FaultKind.CRASH), [], policy, SHA)
    result = PolicyRetry().evaluate(SegmentFaultError("crash", decision), try_number=1,
                                    max_tries=9)
    assert result.action is RetryAction.RETRY
    assert result.retry_delay == timedelta(seconds=90)
    assert result.reason == decision.reason


def test_policy_retry_zero_backoff_retries_at_once() -> None:
    decision = decide(fault(FaultKind.NAN_LOSS), [], make_policy(), SHA)
    result = PolicyRetry().evaluate(SegmentFaultError("nan", decision), 1, 9)
    assert result.action is RetryAction.RETRY
    assert result.retry_delay == timedelta(0)


@pytest.mark.parametrize(("kind", "history"), [
    (FaultKind.CRASH, [FaultKind.CRASH, FaultKind.CRASH]),  # max_attempts reached
    (FaultKind.NAN_LOSS, []),  # abort
    (FaultKind.CORRUPT_CHECKPOINT, []),  # escalate
])
def test_policy_retry_fails_when_the_decision_gives_up(
    kind: FaultKind, history: list[FaultKind]
) -> None:
    policy = make_policy({"nan_loss": {"action": "abort"},
                          "corrupt_checkpoint": {"action": "escalate"}})
    decision = decide(culprit_fault(kind), history, policy, SHA)
    assert decision.retry is False
    result = PolicyRetry().evaluate(SegmentFaultError("gave up", decision), 1, 9)
    assert result.action is RetryAction.FAIL
    assert result.reason == decision.reason


class _Impostor(Exception):
    decision = {"retry": True}  # not a Decision


@pytest.mark.parametrize("exc", [RuntimeError("boom"), ValueError("x"), KeyboardInterrupt(),
                                 _Impostor("not ours")])
def test_policy_retry_leaves_other_exceptions_to_airflow(exc: BaseException) -> None:
    assert PolicyRetry().evaluate(exc, 1, 3).action is RetryAction.DEFAULT


def test_policy_retry_serialization_round_trip() -> None:
    data = PolicyRetry().serialize()
    assert json.loads(json.dumps(data)) == data
    again = PolicyRetry.deserialize(data)
    assert isinstance(again, PolicyRetry)
    assert again.serialize() == data


# -- explain and humanize -------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "text"), [
    (0.5, "500 ms"), (0.25, "250 ms"), (1, "1 second"), (1.5, "1.5 seconds"),
    (30, "30 seconds"), (60, "1 minute"), (90, "90 seconds"), (300, "5 minutes"),
    (900, "15 minutes"), (1800, "30 minutes"), (3600, "1 hour"), (5400, "90 minutes"),
    (4 * 3600, "4 hours"), (86400, "1 day"), (2 * 86400, "2 days"),
])
def test_humanize(seconds: float, text: str) -> None:
    assert humanize(seconds) == text


def paragraphs(text: str) -> dict[str, str]:
    """Map each fault kind to its paragraph of explain's output."""
    found = {}
    for block in text.split("\n\n"):
        for kind in KINDS:
            if f"({kind.value})" in block.splitlines()[0]:
                found[kind.value] = block
    return found


def test_explain_default_policy() -> None:
    loaded = load_policy(DEFAULT)
    text = explain(loaded)
    by_kind = paragraphs(text)

    assert set(by_kind) == {k.value for k in KINDS}  # every kind has its own paragraph
    assert loaded.sha256 in text
    assert "ml-platform-oncall" in text
    assert "kept out of every job for 30 minutes" in by_kind["hang"]
    assert "kept out of every job for 1 hour" in by_kind["node_unresponsive"]
    assert "kept out of every job for 15 minutes" in by_kind["launch_failure"]
    assert "At the 3rd hang in the same segment, it stops and notifies ml-platform-oncall" \
        in by_kind["hang"]
    assert "At the 2nd nan_loss" in by_kind["nan_loss"]
    assert ("It waits 1 second before trying again, 2 times longer after each repeat, at most "
            "30 seconds.") in by_kind["crash"]
    assert "It tries again at once." in by_kind["nan_loss"]
    assert "first has the ranks save a checkpoint" in by_kind["straggler"]
    assert "discards the newest checkpoint" in by_kind["corrupt_checkpoint"]
    assert "kept out" not in by_kind["throughput_degraded"]
    assert "at most 8 attempts" in text
    assert "waits up to 5 minutes" in text


def test_explain_strict_policy() -> None:
    loaded = load_policy(STRICT)
    text = explain(loaded)
    by_kind = paragraphs(text)

    assert set(by_kind) == {k.value for k in KINDS}
    assert loaded.sha256 in text
    assert "Few retries, long quarantines, early escalation." in text
    assert "stops the segment for good, without retrying" in by_kind["nan_loss"]
    assert "notif" not in by_kind["nan_loss"].replace("without notifying anyone", "")
    assert "notifies ml-research-leads" in by_kind["corrupt_checkpoint"]
    assert "notifies ml-platform-oncall" in by_kind["throughput_degraded"]
    assert "max_attempts is 1, so in fact it stops at once" in by_kind["launch_failure"]
    assert "kept out of every job for 1 day" in by_kind["node_unresponsive"]
    assert "kept out of every job for 4 hours" in by_kind["hang"]
    assert "at most 3 attempts" in text
    assert "stops and notifies ml-platform-oncall at once" in text


def test_explain_names_every_kind_even_when_its_detection_is_off(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(write_rules(tmp_path).read_text()
                    + "detection:\n  straggler: null\n  throughput: null\n")
    by_kind = paragraphs(explain(load_policy(path)))
    assert set(by_kind) == {k.value for k in KINDS}


# -- the JSON Schema ---------------------------------------------------------------------------


def test_schema_file_is_in_sync_with_the_model() -> None:
    assert json.loads(policy_schema_text()) == json.loads(SCHEMA.read_text())


def test_schema_accepts_the_shipped_policies_and_rejects_unknown_keys() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    validator = validator_cls(schema)

    for path in (DEFAULT, STRICT):
        raw = yaml.safe_load(path.read_text())
        assert [e.message for e in validator.iter_errors(raw)] == [], path

    raw = yaml.safe_load(DEFAULT.read_text())
    assert not validator.is_valid({**raw, "colour": "blue"})
    assert not validator.is_valid({k: v for k, v in raw.items() if k != "rules"})
    bad_action = {**raw, "rules": {**raw["rules"], "hang": {"action": "reboot"}}}
    assert not validator.is_valid(bad_action)


# -- `relay policy ...` -----------------------------------------------------------------------


def test_cli_policy_check_accepts_the_shipped_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", str(DEFAULT), str(STRICT)]) == 0
    out = capsys.readouterr().out
    for path in (DEFAULT, STRICT):
        assert f"{path}: OK (sha256 {load_policy(path).sha256})" in out


@pytest.mark.parametrize("path", [DEFAULT, STRICT])
def test_cli_policy_explain(capsys: pytest.CaptureFixture[str], path: Path) -> None:
    assert main(["policy", "explain", str(path)]) == 0
    assert capsys.readouterr().out.strip() == explain(load_policy(path)).strip()


@pytest.mark.parametrize("command", ["check", "explain"])
def test_cli_policy_rejects_a_bad_policy_with_file_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    bad = write_rules(tmp_path, crash="{action: reboot}")
    assert main(["policy", command, str(DEFAULT), str(bad)]) == 1
    captured = capsys.readouterr()
    assert f"{bad}:{line_of(bad, 'crash')}: rules.crash.action: expected one of" in captured.err
    assert "Fix: " in captured.err
    assert str(DEFAULT) in captured.out  # the good file is still checked/explained


def test_cli_policy_schema_prints_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "schema"]) == 0
    assert capsys.readouterr().out == policy_schema_text()


# -- preempted: the node is healthy ----------------------------------------------------


def test_a_policy_without_a_preempted_rule_drains_and_moves_on(tmp_path: Path) -> None:
    rule = load_policy(write_rules(tmp_path, preempted=None)).policy.rules.preempted
    assert (rule.action, rule.quarantine) == (Action.CHECKPOINT_AND_MIGRATE, None)


def test_preempted_drains_runs_without_the_node_once_and_quarantines_nothing() -> None:
    d = decide(fault(FaultKind.PREEMPTED, rank=None), [], make_policy(), SHA)

    assert (d.action, d.retry, d.checkpoint_first) == ("checkpoint_and_migrate", True, True)
    assert d.quarantine_node is None and d.quarantine_seconds is None
    assert d.avoid_node == "node-b"
    assert "next attempt without node-b" in d.reason


def test_shipped_policies_name_preempted_without_quarantine() -> None:
    for path in (DEFAULT, STRICT):
        rule = load_policy(path).policy.rules.preempted
        assert rule.action is Action.CHECKPOINT_AND_MIGRATE and rule.quarantine is None
        assert "preempted:" in path.read_text()
