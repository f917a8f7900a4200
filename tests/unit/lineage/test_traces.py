"""A recovery's phases as OpenTelemetry spans (relay.lineage.traces), in an in-memory exporter.

The attempt folders are written by hand as the faulty attempt's task (or warden) and the
retry's task leave them (the helpers of test_resume_time); the two emitting calls are the
ones those processes make.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_resume_time import T0, _faulty_attempt, _retry_attempt

from relay.lineage import traces
from relay.lineage.resume_time import PARTS, complete_previous

FAULT = {"kind": "hang", "culprit_rank": 1, "culprit_node": "node-a"}


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    for name in (traces.ENV_ENDPOINT, *traces.STANDARD_ENDPOINTS):
        monkeypatch.delenv(name, raising=False)
    exporter = InMemorySpanExporter()
    traces.use_exporter(exporter)
    try:
        yield exporter
    finally:
        traces.use_exporter(None)


def _recovery(tmp_path: Path, dag: str = "job", run: str = "manual__1") -> tuple[Path, Path]:
    """Return the faulty and the retry attempt of one recovery, the faulty one's decision
    recorded (its spans emitted as record_decision emits them)."""
    seg = tmp_path / dag / run / "segment-002"
    faulty = _faulty_attempt(seg, injected=True)
    entry = {**json.loads((faulty / "decision.json").read_text()), "fault": FAULT}
    (faulty / "decision.json").write_text(json.dumps(entry))
    traces.emit_recovery(faulty, entry, traces.DECISION_PARTS)
    return faulty, _retry_attempt(seg, standby=True)


def test_a_recovery_is_one_span_over_its_phases_under_the_dag_runs_trace(
    tmp_path: Path, spans: InMemorySpanExporter,
) -> None:
    faulty, retry = _recovery(tmp_path)
    assert {s.name for s in spans.get_finished_spans()} == {
        f"relay.recovery.{p}" for p in traces.DECISION_PARTS}  # the retry's are not known yet

    assert complete_previous(retry) is not None  # as the retry's task does, then:
    traces.emit_resumed(faulty)

    found = {s.name: s for s in spans.get_finished_spans()}
    assert set(found) == {"relay.recovery", *(f"relay.recovery.{p}" for p in PARTS)}
    recovery = found.pop("relay.recovery")
    trace_id = traces.trace_id_of("job", "manual__1")
    assert recovery.context.trace_id == trace_id
    assert recovery.parent is not None
    assert recovery.parent.span_id == traces.run_span_id("job", "manual__1")
    assert recovery.context.span_id == traces.recovery_span_id("job", "manual__1", 2, 1)
    for phase in found.values():  # emitted by two processes that never talked
        assert phase.context.trace_id == trace_id
        assert phase.parent is not None and phase.parent.span_id == recovery.context.span_id
    # The phases tile the recovery: each starts where the one before it ended.
    ordered = [found[f"relay.recovery.{p}"] for p in PARTS]
    assert ordered[0].start_time == recovery.start_time == int((T0 + 0.2) * 1e9)
    assert ordered[-1].end_time == recovery.end_time == int((T0 + 11.5) * 1e9)
    assert all(a.end_time == b.start_time for a, b in zip(ordered, ordered[1:], strict=False))
    for span in (recovery, *found.values()):
        assert {k: (span.attributes or {})[k] for k in (
            "relay.dag_id", "relay.run_id", "relay.segment", "relay.try", "relay.fault.kind",
            "relay.fault.culprit_rank", "relay.fault.culprit_node")} == {
            "relay.dag_id": "job", "relay.run_id": "manual__1", "relay.segment": 2,
            "relay.try": 1, "relay.fault.kind": "hang", "relay.fault.culprit_rank": 1,
            "relay.fault.culprit_node": "node-a"}


def test_each_dag_run_has_its_own_trace_and_each_recovery_its_own_span() -> None:
    assert traces.trace_id_of("job", "run-1") == traces.trace_id_of("job", "run-1")
    assert traces.trace_id_of("job", "run-1") != traces.trace_id_of("job", "run-2")
    assert traces.recovery_span_id("job", "run-1", 0, 1) != \
        traces.recovery_span_id("job", "run-1", 0, 2)


def test_without_an_endpoint_nothing_is_built_or_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in (traces.ENV_ENDPOINT, *traces.STANDARD_ENDPOINTS):
        monkeypatch.delenv(name, raising=False)
    traces.use_exporter(None)
    faulty, retry = _recovery(tmp_path)
    complete_previous(retry)
    traces.emit_resumed(faulty)

    assert traces.otlp_endpoint() is None
    assert "provider" not in traces._state


def test_relays_setting_wins_over_the_standard_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert traces.otlp_endpoint() == "http://collector:4318"
    assert traces._traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    monkeypatch.setenv(traces.ENV_ENDPOINT, "http://relay-collector:4318/v1/traces")
    assert traces.otlp_endpoint() == "http://relay-collector:4318/v1/traces"
    assert traces._traces_url(traces.otlp_endpoint() or "") == \
        "http://relay-collector:4318/v1/traces"


def test_a_recovery_path_emits_from_a_thread_of_its_own(
    tmp_path: Path, spans: InMemorySpanExporter,
) -> None:
    seg = tmp_path / "job" / "run" / "segment-000"
    faulty = _faulty_attempt(seg, injected=False)
    entry = {**json.loads((faulty / "decision.json").read_text()), "fault": FAULT}

    traces.emit_recovery(faulty, entry, traces.DECISION_PARTS, background=True)
    for thread in threading.enumerate():
        if thread.name == "relay-traces":
            thread.join()

    # The fault's onset is unknown (nothing injected): no detect span, the rest as recorded.
    assert {s.name for s in spans.get_finished_spans()} == {
        f"relay.recovery.{p}" for p in traces.DECISION_PARTS if p != "detect"}
