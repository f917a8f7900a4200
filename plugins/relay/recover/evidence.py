"""Evidence from the culprit before it is killed: every rank's stacks and collective trace.

On a hang, or a silent rank or node, Relay asks every rank of the attempt
where it is (see :mod:`relay_train.protocol.stacks_files`) *before* it stops the workload:
after the stop there is nothing left to ask. The request goes to every node's
agent over the channel first, the rescue runs meanwhile, and the answers are
gathered from the agents for at most ``detection.evidence_timeout`` from the
request (2 s by default). At half that time each agent signals its ranks that
have not answered but armed their faulthandler, for a C-level stack dump (a
main thread stuck in C holding the GIL); a rank that answers nothing at all
(SIGSTOPped, a frozen node) is skipped, never waited on.

The fault record gets a compact summary: a one-line ``where``, the culprit's
stack first then the others' main threads, and per rank the last collectives
of each process group from the Flight Recorder (sequence id, op, state).
Everything the ranks wrote (all threads, the raw trace as JSON and as the
pickle torch's analyzer reads) goes to the attempt's MLflow run under
``evidence/``.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relay.core.attempt import Attempt
from relay.core.faults import RESCUABLE, Fault
from relay.launchers import Launcher, launcher_from
from relay.launchers.agent_client import MAX_PARALLEL
from relay.recover.ask_rescue import silent
from relay_train.protocol.heartbeat import write_atomically
from relay_train.protocol.routes import (
    ANSWERS,
    CULPRIT_RANK,
    EXITED,
    FAULT,
    FAULTHANDLER,
    FR_PICKLES,
    REQUEST_ID,
    SIGNALLED,
    TRACES,
    Route,
)
from relay_train.protocol.stacks_files import (
    EVIDENCE_DIR,
    FR_DIR,
    answer_path,
    faulthandler_path,
    fr_dump_path,
    trace_path,
)

if TYPE_CHECKING:
    from relay.launchers.agent_client import AgentChannel
    from relay_train.protocol.launch import LaunchConfig

log = logging.getLogger(__name__)

# The faults where "where is it stuck?" is the question (the same ones a rescue follows).
EVIDENCE_KINDS = RESCUABLE
LAST_COLLECTIVES = 3  # per rank and process group, in the summary
POLL_SECONDS = 0.05
RECEIVED_DIR = "evidence-received"  # Relay's side: what the agents sent, logged to MLflow


@dataclass
class EvidenceRequest:
    """A request sent to the agents of an attempt, to be collected later."""

    folder: Path  # on Relay's side: where the answers are written as they arrive
    request_id: str
    ranks: list[int]
    channel: AgentChannel
    nodes: list[str]  # the agents asked
    unheard: set[int] = field(default_factory=set)  # ranks not waited for (a frozen node's)
    asked_at: float = field(default_factory=time.monotonic)


@dataclass
class Evidence:
    """What the ranks answered within the bound."""

    folder: Path
    answers: dict[int, dict[str, Any]]  # rank -> its stacks record
    traces: dict[int, dict[str, Any]]  # rank -> its Flight Recorder dump (JSON)
    fallback_stacks: dict[int, str]  # rank -> faulthandler text, for ranks that did not answer
    missing: list[int]
    seconds: float


def ask_for_evidence(attempt: Attempt, fault: Fault, cfg: LaunchConfig,
                     launcher: Launcher | None = None) -> EvidenceRequest | None:
    """Ask every node's agent for its ranks' stacks and traces, if ``fault`` needs them.

    A node the fault says is frozen (its agent and ranks) is neither asked nor waited for:
    it would only cost its timeouts before the stop."""
    if fault.kind not in EVIDENCE_KINDS:
        return None
    launcher = launcher or launcher_from(None)
    channel = launcher.channel(attempt)
    frozen, unheard = silent(fault, cfg)
    request = EvidenceRequest(attempt.runs_in / RECEIVED_DIR, uuid.uuid4().hex,
                              list(range(cfg.world_size)), channel,
                              [n for n in channel.addresses if n not in frozen], unheard)
    body = {REQUEST_ID: request.request_id, FAULT: fault.kind.value,
            CULPRIT_RANK: fault.culprit_rank}
    nodes = request.nodes
    if nodes:  # at once to every node: a frozen one costs its timeout, not the others'
        with ThreadPoolExecutor(max_workers=min(len(nodes), MAX_PARALLEL)) as pool:
            asked = list(pool.map(lambda n: channel.ask(n, Route.STACKS, **body), nodes))
        if not any(asked):
            log.warning("No node agent took the request for stacks; going on without")
    return request


def _gather(request: EvidenceRequest, timeout: float) -> list[dict[str, Any]]:
    """Ask every agent asked for the answers so far, at once, within ``timeout``."""
    nodes = request.nodes
    if not nodes:
        return []

    def one(node: str) -> dict[str, Any] | None:
        try:
            reply = request.channel.call(node, Route.STACKS, query={REQUEST_ID: request.request_id},
                                         timeout=max(timeout, 0.05))
        except LookupError:  # a stale agent: refused and recorded by the channel
            return None
        return reply if isinstance(reply, dict) else None

    with ThreadPoolExecutor(max_workers=min(len(nodes), MAX_PARALLEL)) as pool:
        return [r for r in pool.map(one, nodes) if r is not None]


def _signal(request: EvidenceRequest) -> None:
    """Have each agent dump its silent ranks' stacks from C (faulthandler)."""
    for node in request.nodes:
        reply = request.channel.ask(node, Route.STACKS_SIGNAL, **{REQUEST_ID: request.request_id})
        if reply and reply.get(SIGNALLED):
            log.info("Agent of %s signalled rank(s) %s for a C-level stack dump", node,
                     reply[SIGNALLED])


def collect_evidence(request: EvidenceRequest, timeout_seconds: float) -> Evidence:
    """Gather the answers until every living rank answered, or ``timeout_seconds`` passed."""
    deadline = request.asked_at + timeout_seconds
    fallback_at = request.asked_at + timeout_seconds / 2
    answers: dict[int, dict[str, Any]] = {}
    traces: dict[int, dict[str, Any]] = {}
    pickles: dict[int, bytes] = {}
    fallback: dict[int, str] = {}
    exited: set[int] = set()
    signalled = False
    while True:
        for reply in _gather(request, deadline - time.monotonic()):
            answers |= {int(r): v for r, v in (reply.get(ANSWERS) or {}).items()}
            traces |= {int(r): v for r, v in (reply.get(TRACES) or {}).items()}
            pickles |= {int(r): base64.b64decode(v)
                        for r, v in (reply.get(FR_PICKLES) or {}).items()}
            fallback |= {int(r): v for r, v in (reply.get(FAULTHANDLER) or {}).items()}
            exited |= {int(r) for r in reply.get(EXITED) or []}
        waiting = [r for r in request.ranks if r not in answers and r not in request.unheard]
        exited &= set(waiting)
        now = time.monotonic()
        if not set(waiting) - exited or now >= deadline:
            break
        if now >= fallback_at and not signalled:
            _signal(request)
            signalled = True
        time.sleep(POLL_SECONDS)
    fallback = {r: t for r, t in fallback.items() if r not in answers and t.strip()}
    _keep(request.folder, answers, traces, pickles, fallback)
    missing = [r for r in request.ranks if r not in answers and r not in fallback]
    if exited:
        log.info("Rank(s) %s had exited: no stacks to ask them for", sorted(exited))
    seconds = time.monotonic() - request.asked_at
    if missing:
        log.warning("No stacks from rank(s) %s within %.1fs (stopped or frozen?); skipped",
                    missing, timeout_seconds)
    return Evidence(request.folder, answers, traces, fallback, missing, seconds)


def _keep(folder: Path, answers: dict[int, dict[str, Any]], traces: dict[int, dict[str, Any]],
          pickles: dict[int, bytes], fallback: dict[int, str]) -> None:
    """Write what arrived on Relay's side, in the layout the ranks use (for MLflow)."""
    try:
        (folder / FR_DIR).mkdir(parents=True, exist_ok=True)
        for rank, record in answers.items():
            write_atomically(answer_path(folder, rank), json.dumps(record, indent=1))
        for rank, trace in traces.items():
            write_atomically(trace_path(folder, rank), json.dumps(trace))
        for rank, data in pickles.items():
            fr_dump_path(folder, rank).write_bytes(data)
        for rank, text in fallback.items():
            faulthandler_path(folder, rank).write_text(text)
    except OSError as exc:  # evidence helps the on-call engineer; it never holds up recovery
        log.warning("Could not keep the ranks' evidence in %s (%s)", folder, exc)


def kept_evidence(folder: Path, ranks: list[int], seconds: float = 0.0) -> Evidence:
    """Return the evidence gathered earlier into ``folder`` (by a warden, before its stop):
    no agent is left to ask."""
    def load(path: Path) -> dict[str, Any] | None:
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return None

    answers = {r: a for r in ranks if (a := load(answer_path(folder, r))) is not None}
    traces = {r: t for r in ranks if (t := load(trace_path(folder, r))) is not None}
    fallback = {r: faulthandler_path(folder, r).read_text() for r in ranks
                if r not in answers and faulthandler_path(folder, r).is_file()}
    missing = [r for r in ranks if r not in answers and r not in fallback]
    return Evidence(folder, answers, traces, fallback, missing, seconds)


def _frame_lines(thread: dict[str, Any]) -> list[str]:
    """Return ``file:line in function: code`` lines, innermost last (like a traceback)."""
    return [f"{f['file']}:{f['line']} in {f['function']}: {f['code']}".rstrip(": ")
            for f in thread["frames"]]


def _stacks(record: dict[str, Any], all_threads: bool) -> dict[str, list[str]]:
    threads = record["threads"] if all_threads else [t for t in record["threads"] if t["main"]]
    return {("main" if t["main"] else t["thread"]): _frame_lines(t) for t in threads}


def summarize_trace(trace: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Return per process group the last collectives: sequence id, op, state, finished."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for entry in trace.get("entries", []):
        group = entry.get("process_group", ["?", "?"])
        name = f"{group[1]} ({group[0]})" if isinstance(group, list) and len(group) == 2 else "?"
        groups.setdefault(name, []).append({
            "seq": entry.get("collective_seq_id"), "op": entry.get("profiling_name"),
            "state": entry.get("state"), "finished": bool(entry.get("retired")),
            "sizes": entry.get("input_sizes"),
        })
    return {name: entries[-LAST_COLLECTIVES:] for name, entries in groups.items()}


def _innermost(record: dict[str, Any]) -> str:
    main = next((t for t in record["threads"] if t["main"]), None)
    if main is None or not main["frames"]:
        return "an unknown place"
    frame = main["frames"][-1]
    return f"{frame['function']} ({Path(frame['file']).name}:{frame['line']})"


def _waiting_in(trace: dict[str, Any] | None) -> str | None:
    unfinished = [e for e in (trace or {}).get("entries", []) if not e.get("retired")]
    if not unfinished:
        return None
    first = unfinished[0]
    return f"{first.get('profiling_name')} #{first.get('collective_seq_id')}"


def where(evidence: Evidence, culprit: int | None) -> str:
    """Return one line: where the culprit is, and what the others wait in."""
    parts = []
    if culprit is not None:
        if culprit in evidence.answers:
            parts.append(f"rank {culprit} in {_innermost(evidence.answers[culprit])}")
        elif culprit in evidence.fallback_stacks:
            parts.append(f"rank {culprit}: C-level stack only (see stacks)")
        else:
            parts.append(f"rank {culprit} did not answer (stopped or frozen)")
    for rank in sorted(evidence.answers):
        if rank == culprit:
            continue
        waiting = _waiting_in(evidence.traces.get(rank))
        parts.append(f"rank {rank} " + (f"waits in {waiting}" if waiting
                                        else f"in {_innermost(evidence.answers[rank])}"))
    return "; ".join(parts)


def evidence_summary(evidence: Evidence, culprit: int | None) -> dict[str, Any]:
    """Return the fault evidence to add: culprit's stack first, others', the collectives."""
    order = sorted(evidence.answers, key=lambda r: (r != culprit, r))
    stacks = [{"rank": r, "node": evidence.answers[r].get("node"), "culprit": r == culprit,
               "threads": _stacks(evidence.answers[r], all_threads=r == culprit)} for r in order]
    stacks += [{"rank": r, "culprit": r == culprit, "faulthandler": text.splitlines()}
               for r, text in evidence.fallback_stacks.items()]
    stacks.sort(key=lambda s: not s["culprit"])
    return {
        "where": where(evidence, culprit),
        "stacks": stacks,
        "collectives": {str(r): summarize_trace(t) for r, t in sorted(evidence.traces.items())},
        "stacks_missing_ranks": evidence.missing,
        "evidence_seconds": round(evidence.seconds, 3),
        "evidence_artifacts": f"{EVIDENCE_DIR}/ (all threads: rank-N.json; Flight Recorder: "
                              "fr-rank-N.json, and fr/ for python -m "
                              "torch.distributed.flight_recorder.fr_trace)",
    }


def attach_evidence(fault_record: dict[str, Any], evidence: Evidence,
                    lineage: Any, run_id: str) -> None:  # noqa: ANN401
    """Add the summary to a fault record's evidence; log the ranks' files to its MLflow run."""
    try:
        summary = evidence_summary(evidence, fault_record.get("culprit_rank"))
    except (KeyError, TypeError, AttributeError) as exc:  # a rank's record not as expected
        summary = {"evidence_error": f"unreadable rank record ({exc!r}); see {EVIDENCE_DIR}/"}
    fault_record["evidence"].update(summary)
    answered = len(evidence.answers) + len(evidence.fallback_stacks)
    # The task log shows "where it stopped" once, in the decision's details (pipeline).
    log.debug("Where it stopped: %s (evidence from %d of %d ranks in %.2fs)",
                summary.get("where", "unknown"), answered, answered + len(evidence.missing),
                evidence.seconds)
    try:  # everything the ranks wrote, under evidence/ in the attempt's run
        lineage.log_folder(run_id, evidence.folder, EVIDENCE_DIR)
    except Exception as exc:  # noqa: BLE001 - the fault record must still be written
        log.warning("Could not log %s to MLflow run %s (%s); the files stay there",
                    evidence.folder, run_id, exc)
