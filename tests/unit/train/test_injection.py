"""Unit tests for an injected fault: parsing the run conf's entries, and where it strikes."""

from __future__ import annotations

import pytest

from relay_train.protocol.injection import InjectedFault

WHERE = {"segment": 1, "attempt": 1, "step": 30, "rank": 1, "node": "node-b"}


def test_from_dict_builds_a_fault() -> None:
    fault = InjectedFault.from_dict({"kind": "crash", "segment": 1, "step": 30, "rank": 1})

    assert fault == InjectedFault(kind="crash", step=30, segment=1, rank=1, node=None, attempt=1)


@pytest.mark.parametrize("kind", ["explode", "", None, "CRASH"])
def test_from_dict_rejects_unknown_kinds(kind: object) -> None:
    with pytest.raises(ValueError, match="kind") as info:
        InjectedFault.from_dict({"kind": kind, "step": 3})
    assert repr(kind) in str(info.value)
    assert "crash" in str(info.value)  # says what would have been accepted


def test_from_dict_rejects_missing_kind() -> None:
    with pytest.raises(ValueError, match="None"):
        InjectedFault.from_dict({"step": 3})


def test_from_dict_rejects_unknown_fields_naming_them() -> None:
    with pytest.raises(ValueError, match="unknown fields") as info:
        InjectedFault.from_dict({"kind": "crash", "step": 3, "rnak": 1, "when": "now"})
    assert "rnak" in str(info.value)
    assert "when" in str(info.value)
    assert "step" not in str(info.value)



def test_strikes_when_everything_matches() -> None:
    fault = InjectedFault(kind="crash", step=30, segment=1, rank=1, node="node-b", attempt=1)

    assert fault.strikes(**WHERE)


@pytest.mark.parametrize(
    ("field", "value"),
    [("segment", 2), ("attempt", 2), ("step", 29), ("step", 31), ("rank", 0), ("node", "node-a")],
)
def test_strikes_only_where_planned(field: str, value: object) -> None:
    fault = InjectedFault(kind="crash", step=30, segment=1, rank=1, node="node-b", attempt=1)

    assert not fault.strikes(**{**WHERE, field: value})


def test_unset_fields_match_anything() -> None:
    fault = InjectedFault(kind="crash", step=30)  # any segment, any rank, any node; attempt 1

    assert fault.strikes(**WHERE)
    assert fault.strikes(**{**WHERE, "segment": 9, "rank": 5, "node": "node-z"})
    assert not fault.strikes(**{**WHERE, "attempt": 2})  # Airflow's retry runs clean
    assert not fault.strikes(**{**WHERE, "step": 31})


def test_node_fault_hits_every_rank_of_that_node() -> None:
    fault = InjectedFault(kind="crash", step=30, node="node-b")

    assert fault.strikes(**{**WHERE, "rank": 0})
    assert fault.strikes(**{**WHERE, "rank": 3})
    assert not fault.strikes(**{**WHERE, "node": "node-a"})
