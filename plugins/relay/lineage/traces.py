"""A recovery's phases as OpenTelemetry spans: one trace per DAG run.

The marks of :mod:`relay.lineage.resume_time` become spans after the fact (each with the
start and end its marks give): one ``relay.recovery`` span per recovery, from the fault's
onset to the retry's first productive step, and under it one span per part
(``relay.recovery.detect``, ``.wake``, ``.decide``, ``.rescue``, ``.stop``, ``.record``,
``.retry_scheduling``, ``.launch``, ``.agent_start``, ``.rendezvous``, ``.first_step``).
Two processes emit them and never talk: whoever records the decision (the segment task,
or the warden: :func:`relay.recover.record.record_decision`) emits the parts up to
``record``; the retry's task, once it completes the breakdown
(:func:`relay.lineage.resume_time.complete_previous`), emits the rest and the recovery
span itself. They join one trace because every id is derived, not drawn: the trace id
from the DAG run (its DAG id and run), the recovery span's id from the faulty attempt
(segment and try), and every recovery's parent is the DAG run's span id (a span no one
emits: the run's root). Each span carries the attempt's identity (``relay.dag_id``,
``relay.run_id``, ``relay.segment``, ``relay.try``, ``relay.fault.kind``,
``relay.fault.culprit_node``, ``relay.fault.culprit_rank``).

Export: OTLP over HTTP to ``RELAY_OTLP_ENDPOINT``, else the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``; with none set,
nothing is built and every call here is a no-op. Spans leave in the background and are
flushed when the process exits, so tracing adds nothing to a recovery's time; a failure to
trace is logged, never raised.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

from relay.core.attempt import Attempt
from relay.lineage.resume_time import PARTS

log = logging.getLogger(__name__)

ENV_ENDPOINT = "RELAY_OTLP_ENDPOINT"  # Relay's own setting; the OTEL_* standard ones follow
STANDARD_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
EXPORT_TIMEOUT_SECONDS = 2.0
RECOVERY_SPAN = "relay.recovery"
DECISION_FILE = "decision.json"
DECISION_PARTS = PARTS[:PARTS.index("record") + 1]  # timed by whoever records the decision
RETRY_PARTS = PARTS[len(DECISION_PARTS):]  # timed by the retry's task


def otlp_endpoint() -> str | None:
    """Return where spans go (Relay's setting first, then the standard ones), or None."""
    for name in (ENV_ENDPOINT, *STANDARD_ENDPOINTS):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def _derived(size: int, *parts: object) -> int:
    digest = hashlib.sha256("\n".join(["relay-trace", *map(str, parts)]).encode()).digest()
    return int.from_bytes(digest[:size], "big") or 1  # 0 is OpenTelemetry's "invalid"


def trace_id_of(dag_id: str, run: str) -> int:
    """Return the trace id of a DAG run (the same in every process)."""
    return _derived(16, dag_id, run)


def run_span_id(dag_id: str, run: str) -> int:
    """Return the span id of a DAG run's root: every recovery's parent."""
    return _derived(8, dag_id, run, "run")


def recovery_span_id(dag_id: str, run: str, segment: int | None, try_number: int | None) -> int:
    """Return the span id of the recovery from one faulty attempt."""
    return _derived(8, dag_id, run, segment, try_number, "recovery")


class _Ids(IdGenerator):
    """Random ids, except the one span id the caller names for its next span."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self.next_span_id: int | None = None

    def generate_span_id(self) -> int:
        chosen, self.next_span_id = self.next_span_id, None
        return chosen if chosen is not None else self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        return self._random.generate_trace_id()


_state: dict[str, Any] = {}  # "provider", "ids", "endpoint": built once per process


def use_exporter(exporter: SpanExporter | None) -> None:
    """Send spans to ``exporter`` synchronously (tests: an ``InMemorySpanExporter``);
    None: back to the environment's setting."""
    _state.clear()
    if exporter is not None:
        _build(SimpleSpanProcessor(exporter), "exporter")


def _build(processor: SpanProcessor, endpoint: str) -> None:
    ids = _Ids()
    provider = TracerProvider(resource=Resource.create({"service.name": "relay"}),
                              id_generator=ids)
    provider.add_span_processor(processor)
    _state.update(provider=provider, ids=ids, endpoint=endpoint)


def _tracer() -> tuple[trace.Tracer, _Ids] | None:
    endpoint = otlp_endpoint()
    if "provider" not in _state or (_state["endpoint"] not in ("exporter", endpoint)):
        _state.clear()
        if endpoint is None:
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        _build(BatchSpanProcessor(OTLPSpanExporter(endpoint=_traces_url(endpoint),
                                                   timeout=EXPORT_TIMEOUT_SECONDS)), endpoint)
    return _state["provider"].get_tracer("relay.recovery"), _state["ids"]


def _traces_url(endpoint: str) -> str:
    """Return the OTLP/HTTP traces URL of ``endpoint`` (a collector's base URL, as the
    standard variable gives it, gets ``/v1/traces``)."""
    if os.environ.get(STANDARD_ENDPOINTS[0], "").strip() == endpoint or \
            endpoint.rstrip("/").endswith("/v1/traces"):
        return endpoint
    return endpoint.rstrip("/") + "/v1/traces"


def identity(attempt: Attempt, entry: Mapping[str, Any]) -> dict[str, Any]:
    """Return the span attributes naming the faulty attempt and its fault."""
    fault = entry.get("fault") or {}
    found = {"relay.dag_id": attempt.dag_id, "relay.run_id": attempt.run,
             "relay.segment": attempt.segment, "relay.try": attempt.try_number,
             "relay.fault.kind": fault.get("kind"),
             "relay.fault.culprit_node": fault.get("culprit_node"),
             "relay.fault.culprit_rank": fault.get("culprit_rank")}
    return {k: v for k, v in found.items() if v is not None}


def enabled() -> bool:
    """Return whether spans go anywhere (an endpoint, or a test's exporter)."""
    return otlp_endpoint() is not None or _state.get("endpoint") == "exporter"


def emit_recovery(attempt_dir: Path, entry: Mapping[str, Any], parts: Iterable[str], *,
                  background: bool = False) -> None:
    """Emit the spans of ``parts`` of the recovery from the faulty attempt in ``attempt_dir``
    (``entry``: its decision.json, with ``time_to_resume``), and the recovery span once the
    breakdown is complete. ``background``: from a thread of its own (the first export loads
    the OTLP client, ~0.6 s here: not on a recovery's path; the process waits for it at
    exit). No-op without an endpoint; never raises."""
    if not enabled():
        return
    args = (Path(attempt_dir), copy.deepcopy(dict(entry)), tuple(parts))
    if background:
        threading.Thread(target=_emit_logged, args=args, name="relay-traces").start()
    else:
        _emit_logged(*args)


def _emit_logged(attempt_dir: Path, entry: dict[str, Any], parts: tuple[str, ...]) -> None:
    try:
        _emit(Attempt(attempt_dir), entry, parts)
    except Exception:  # noqa: BLE001 - tracing must never fail a recovery
        log.exception("Could not emit the recovery spans of %s", attempt_dir)


def emit_resumed(faulty_dir: Path, *, background: bool = False) -> None:
    """Emit the retry's parts and the recovery span, once the retry's task completed the
    breakdown in the faulty attempt's ``decision.json`` (``background``: as for
    :func:`emit_recovery`). No-op without an endpoint."""
    if not enabled():
        return
    try:
        entry = json.loads((faulty_dir / DECISION_FILE).read_text())
    except (OSError, ValueError) as exc:
        log.warning("No recovery spans for %s: expected its %s, found none readable (%s)",
                    faulty_dir, DECISION_FILE, exc)
        return
    emit_recovery(faulty_dir, entry, RETRY_PARTS, background=background)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _emit(attempt: Attempt, entry: Mapping[str, Any], parts: tuple[str, ...]) -> None:
    found = _tracer()
    if found is None:
        return
    tracer, ids = found
    breakdown = entry.get("time_to_resume") or {}
    marks: dict[str, float] = breakdown.get("marks") or {}
    dag_id, run = attempt.dag_id, attempt.run
    trace_id = trace_id_of(dag_id, run)
    attributes = identity(attempt, entry)
    recovery_id = recovery_span_id(dag_id, run, attempt.segment, attempt.try_number)

    def under(span_id: int) -> Any:  # noqa: ANN401 - an OpenTelemetry Context
        return trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
            trace_id, span_id, is_remote=True,
            trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))))

    order = ["onset", *PARTS]
    for part in parts:
        if part not in marks or (part == "detect" and breakdown.get("onset") == "unknown"):
            continue  # not reached yet; or the fault's onset is unknown: no detect span
        before = next(marks[p] for p in reversed(order[:order.index(part)]) if p in marks)
        span = tracer.start_span(f"{RECOVERY_SPAN}.{part}", context=under(recovery_id),
                                 attributes=attributes, start_time=_ns(before))
        span.end(end_time=_ns(marks[part]))
    if breakdown.get("complete") and RETRY_PARTS[-1] in parts:
        ids.next_span_id = recovery_id
        span = tracer.start_span(RECOVERY_SPAN, context=under(run_span_id(dag_id, run)),
                                 attributes={**attributes,
                                             "relay.time_to_resume": breakdown.get("total"),
                                             "relay.onset": str(breakdown.get("onset"))},
                                 start_time=_ns(marks["onset"]))
        span.end(end_time=_ns(marks[RETRY_PARTS[-1]]))
