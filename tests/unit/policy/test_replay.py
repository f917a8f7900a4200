"""`relay policy replay`: recorded incidents in a real MLflow store, re-decided by a candidate."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from relay.core.attempt import AttemptState
from relay.core.faults import Fault, FaultKind
from relay.core.settings import REPO_ROOT
from relay.lineage.store import Lineage
from relay.policy.decide import decide
from relay.policy.model import load_policy
from relay.policy.replay import Incident, load_incidents, replay, summary
from relay.policy.rules import Mode
from relay.tools.cli import main

DEFAULT = load_policy(REPO_ROOT / "policies" / "default.yaml")
STRICT = REPO_ROOT / "policies" / "strict.yaml"
JOB = "replayed"


def crash(node: str = "node-b", rank: int = 3) -> Fault:
    return Fault(FaultKind.CRASH, rank, node, {"summary": "exit -9"}, 1000.0)


def straggler() -> Fault:
    return Fault(FaultKind.STRAGGLER, 1, "node-b", {"summary": "2.1x median"}, 1000.0)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lineage]:
    """A real MLflow store holding what the default policy decided in one DAG run:
    segment 0 crashed three times (retried each time), segment 1 met a straggler
    (migrated, node-b quarantined) and an observed-only hang."""
    tmp_path = tmp_path_factory.mktemp("replay")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("RELAY_MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("RELAY_MLFLOW_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    lineage = Lineage.from_settings()
    parent = lineage.parent_run(JOB, f"relay_{JOB}", "manual__1")
    history: dict[int, list[FaultKind]] = {}
    for segment, tries in ((0, [crash(), crash(), crash()]), (1, [straggler()])):
        for number, fault in enumerate(tries, start=1):
            run = lineage.attempt_run(parent, segment, number, {"segment": segment})
            past = history.setdefault(segment, [])
            decision = decide(fault, past, DEFAULT.policy, DEFAULT.sha256)
            if segment == 1:  # an observed hang earlier in the same attempt
                hang = Fault(FaultKind.HANG, 2, "node-c", {"summary": "stuck"}, 999.0)
                observed = decide(hang, past, DEFAULT.policy.model_copy(
                    update={"mode": Mode.OBSERVE}), DEFAULT.sha256)
                lineage.log_json(run, "observed/001.json", {
                    "fault": hang.to_event()["fault"], "decision": observed.to_dict(),
                    "mode": "observe"})
            lineage.log_json(run, "decision.json", {"fault": fault.to_event()["fault"],
                                                    "decision": decision.to_dict()})
            lineage.finish_run(run, AttemptState.FAULTED, {"relay.fault_kind": fault.kind.value})
            past.append(fault.kind)
    yield lineage
    monkeypatch.undo()


def test_incidents_are_read_back_in_order_with_their_decisions(store: Lineage) -> None:
    incidents = load_incidents(store, JOB)
    kinds = [(i.segment, i.attempt, i.fault.kind.value, i.ended_attempt) for i in incidents]
    assert kinds == [(0, 1, "crash", True), (0, 2, "crash", True), (0, 3, "crash", True),
                     (1, 1, "hang", False), (1, 1, "straggler", True)]
    assert [i.then.action for i in incidents] == ["retry", "retry", "escalate",
                                                 "restart_elsewhere", "checkpoint_and_migrate"]
    assert incidents[3].then.observe


def test_the_same_rules_enforced_replay_the_same_and_the_observed_hang_now_acts(
    store: Lineage,
) -> None:
    rows = replay(load_incidents(store, JOB), DEFAULT.policy, DEFAULT.sha256)
    assert [r.changed for r in rows] == [False, False, False, True, False]
    totals = summary(rows)
    assert totals["then"] == {"retries": 2 + 1, "escalations": 1, "observed": 1,
                              "quarantined": ["node-b"]}
    assert totals["now"] == {"retries": 2 + 2, "escalations": 1, "observed": 0,
                             "quarantined": ["node-b", "node-c"]}


def test_the_strict_candidate_escalates_sooner_and_the_cli_prints_the_diff(
    store: Lineage, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["policy", "replay", str(STRICT), "--job", JOB]) == 0
    out = capsys.readouterr().out
    blocks = out.split("\n\n")[0].split("manual__1 ")[1:]
    assert blocks[0].startswith("segment 0 try 1: crash (node node-b, rank 3): exit -9 [same]")
    assert blocks[1].startswith("segment 0 try 2: crash (node node-b, rank 3): exit -9 [CHANGED]")
    assert "then: retry" in blocks[1] and "now:  escalate" in blocks[1]
    assert "not reached: the candidate stops this segment earlier" in blocks[2]
    assert "segment 1 try 1: hang" in blocks[3] and "[CHANGED]" in blocks[3]  # now enforced
    assert "quarantine node-b" in blocks[4]
    assert "attempts spent on retries: then 3, now 3" in out
    assert "escalations:               then 1, now 1" in out
    assert "observed only:             then 1, now 0" in out
    assert "5 recorded fault(s) of job replayed" in out


def test_since_filters_and_bad_arguments_say_what_to_do(
    store: Lineage, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["policy", "replay", str(STRICT), "--job", JOB, "--since", "2999-01-01"]) == 0
    assert "nothing to replay" in capsys.readouterr().out
    assert main(["policy", "replay", str(STRICT), "--job", JOB, "--since", "yesterday"]) == 2
    assert "expected a date such as 2026-12-01" in capsys.readouterr().err
    assert main(["policy", "replay", str(STRICT), "--job", "nope"]) == 2
    assert "expected an MLflow experiment relay/nope" in capsys.readouterr().err


def test_replay_is_pure_over_incidents() -> None:
    incident = Incident("r", 0, 1, crash(), decide(crash(), [], DEFAULT.policy, "x"), True)
    assert replay([incident], DEFAULT.policy, "x")[0].now == incident.then
