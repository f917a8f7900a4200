"""Observe mode: the same decision, marked observe and addressed, never applied."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_rules_decide import BASE_RULES, SHA, culprit_fault, make_policy

from relay.core.exceptions import ConfigError
from relay.core.faults import FaultKind
from relay.core.settings import REPO_ROOT
from relay.policy.decide import Decision, decide
from relay.policy.explain import explain
from relay.policy.model import LoadedPolicy, load_policy
from relay.policy.observe import watched_kinds
from relay.watch.triggers import SegmentWatchTrigger


@pytest.mark.parametrize("kind", list(FaultKind))
@pytest.mark.parametrize("history", [0, 1, 5])
def test_an_observed_decision_is_the_enforced_one_marked_and_notified(
    kind: FaultKind, history: int
) -> None:
    enforce = make_policy()
    observe = make_policy(mode="observe")
    past = [kind] * history
    then = decide(culprit_fault(kind), past, enforce, SHA)
    now = decide(culprit_fault(kind), past, observe, SHA)
    assert not then.observe and now.observe
    assert now.notify is not None  # a notification always goes out
    assert now.reason.startswith(f"observe mode, not applied: Relay would {then.action}")
    same = ("action", "retry", "backoff_seconds", "quarantine_node", "quarantine_seconds",
            "checkpoint_first", "rollback", "rule", "occurrence", "max_attempts")
    assert [getattr(now, f) for f in same] == [getattr(then, f) for f in same]


def test_a_rule_can_observe_while_the_policy_enforces_and_the_reverse() -> None:
    rules = {"straggler": {**BASE_RULES["straggler"], "mode": "observe"}}
    policy = make_policy(rules)
    assert decide(culprit_fault(FaultKind.STRAGGLER), [], policy, SHA).observe
    assert not decide(culprit_fault(FaultKind.CRASH), [], policy, SHA).observe
    rules = {"crash": {**BASE_RULES["crash"], "mode": "enforce"}}
    policy = make_policy(rules, mode="observe")
    assert not decide(culprit_fault(FaultKind.CRASH), [], policy, SHA).observe
    assert decide(culprit_fault(FaultKind.HANG), [], policy, SHA).observe


def test_a_bad_mode_is_an_error_at_its_line(tmp_path: Path) -> None:
    text = (REPO_ROOT / "policies" / "default.yaml").read_text()
    path = tmp_path / "p.yaml"
    path.write_text(text.replace("mode: enforce ", "mode: watch   ", 1))
    with pytest.raises(ConfigError, match=r"p.yaml:\d+: mode: expected one of 'enforce'"):
        load_policy(path)


def test_explain_says_which_rules_only_observe(tmp_path: Path) -> None:
    text = (REPO_ROOT / "policies" / "default.yaml").read_text()
    path = tmp_path / "p.yaml"
    path.write_text(text.replace("    action: checkpoint_and_migrate\n    max_attempts: 3\n",
                                 "    action: checkpoint_and_migrate\n    max_attempts: 3\n"
                                 "    mode: observe\n", 1))
    out = explain(load_policy(path))
    assert "OBSERVE MODE for straggler:" in out
    assert out.count("OBSERVE ONLY") == 1
    straggler = out.index("When one rank is slow (straggler)")
    assert out.index("OBSERVE ONLY") > straggler
    assert "OBSERVE" not in explain(load_policy(REPO_ROOT / "policies" / "default.yaml"))


def test_old_decision_records_without_the_observe_field_still_load() -> None:
    d = decide(culprit_fault(FaultKind.CRASH), [], make_policy(), SHA)
    raw = d.to_dict()
    del raw["observe"]
    assert Decision.from_dict(raw) == d
    assert Decision.from_dict({**d.to_dict(), "future_field": 1}) == d


def test_observed_kinds_are_no_longer_watched_but_crashes_always_are(tmp_path: Path) -> None:
    assert watched_kinds(tmp_path) == [k.value for k in FaultKind]
    for n, kind in enumerate(("straggler", "crash"), start=1):
        (tmp_path / f"observed-{n:03d}.json").write_text(json.dumps({"fault": {"kind": kind}}))
    watched = watched_kinds(tmp_path)
    assert "straggler" not in watched and "crash" in watched and "hang" in watched
    trigger = SegmentWatchTrigger(str(tmp_path), {"n": [0]}, kinds=watched)
    assert SegmentWatchTrigger(**trigger.serialize()[1]).kinds == watched


def test_observe_mode_is_in_the_shipped_default_as_a_documented_key() -> None:
    loaded: LoadedPolicy = load_policy(REPO_ROOT / "policies" / "default.yaml")
    assert loaded.policy.mode.value == "enforce"
    assert dataclasses.is_dataclass(Decision)
