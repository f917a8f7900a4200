"""The node agent's side of the channel between Relay and a node: a small HTTP API.

Relay never reads a file a node wrote; it asks the node's agent, over the network
(the same way on one machine and on a cluster). The agent serves, on the address
its launcher gave it (127.0.0.1 locally, the pod's address on Kubernetes):

- ``GET /v1/status``: its attempt, its state, its ranks' exit codes and log tails, and
  every local rank's heartbeat with its ``age_seconds`` (and ``phase_age_seconds``)
  measured on this node's clock against the rank's own record, so Relay can place
  it on its own clock (``received_at - age``) whatever this node's clock says; and,
  from the node hosting rank 0, the last segment boundaries rank 0 recorded crossing
  (``crossed``: steps, from its ``boundaries.jsonl``; see :mod:`relay_train.boundary`);
- ``POST /v1/stop``, ``/v1/drain`` (``stop_at``), ``/v1/rescue`` (``rank``),
  ``/v1/stacks`` (``id``), ``/v1/stacks/signal`` (``id``): requests, which the agent
  hands to its ranks on node-local disk (the files of
  :mod:`relay_train.protocol.rescue_files` and :mod:`relay_train.protocol.stacks_files`);
- ``GET /v1/rescue``, ``/v1/rescue/file``, ``/v1/stacks``: the ranks' answers;
- ``POST /v1/standby`` (``directory``, ``ttl``, ``linger``): fork a standby agent for this
  node's next attempt (see :mod:`relay_train.agent.standby`): a copy of this agent, already
  preloaded, that leaves this attempt's process group and waits in ``directory``;
  answers its ``pid``;
- ``POST /v1/claim`` (``by``): who acts on this attempt's fault (Relay's
  ``execute_complete`` or its warden, maybe on different machines). The agent
  grants the first claimer and names it to every later one (``granted``,
  ``holder``); see :mod:`relay.recover.claim` for how Relay counts the answers.

Fencing: every request names its attempt (``attempt`` in the query or the body)
and every reply carries the agent's own; a request for another attempt gets
409 with the agent's attempt (status is answered anyway: Relay refuses a stale
agent's heartbeats itself, and records it). The routes, fields and node states are
spelled in :mod:`relay_train.protocol.routes`. Where the agent's environment names a
certificate and key (on Kubernetes), it serves TLS: :mod:`relay_train.protocol.channel_tls`.
Stdlib only.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlparse

from relay_train.protocol import routes as wire
from relay_train.protocol.channel_tls import serve_tls, server_context_from_env
from relay_train.protocol.heartbeat import node_clock, read_heartbeats, write_atomically
from relay_train.protocol.launch import BOUNDARIES_FILE, DRAIN_FILE
from relay_train.protocol.pids import signal_process, start_time
from relay_train.protocol.rescue_files import ACK_FILE, DONE_FILE, RESCUE_DIR
from relay_train.protocol.rescue_files import REQUEST_FILE as RESCUE_REQUEST
from relay_train.protocol.routes import MAX_BODY_BYTES, Route, route_path
from relay_train.protocol.stacks_files import (
    EVIDENCE_DIR,
    answer_path,
    armed_path,
    faulthandler_path,
    fr_dump_path,
    trace_path,
)
from relay_train.protocol.stacks_files import REQUEST_FILE as STACKS_REQUEST

log = logging.getLogger("relay_train.agent.server")

CROSSED_REPORTED = 16  # the last boundary crossings a status answer carries (Relay keeps all)
# How often the server's loop looks for a shutdown: closing waits for it, and a stopping agent
# closes its server before it exits (the default 0.5 s was most of a stop's wait).
SERVE_POLL_SECONDS = 0.05


class Served(Protocol):
    """What the server needs from a node agent."""

    node: str
    attempt_id: str
    root: Path  # the attempt's node-local folder (heartbeats, requests, answers)
    ranks: list[int]  # this node's global ranks

    def status_record(self) -> dict[str, Any]:
        """Return the agent's state, exit codes and errors (no heartbeats)."""
        ...

    def request_stop(self, reason: str) -> None:
        """Stop the ranks and end, as on SIGTERM."""
        ...

    def request_standby(self, directory: Path, ttl: float, linger: float) -> int | None:
        """Fork a preloaded standby for the node's next attempt; return its PID."""
        ...


def heartbeat_report(directory: Path, ranks: list[int], now: float) -> list[dict[str, Any]]:
    """Return the ranks' latest heartbeats, each with its ages on this node's clock."""
    beats = read_heartbeats(directory)
    report = []
    for rank in sorted(r for r in beats if r in ranks):
        beat = beats[rank]
        record = json.loads(beat.to_json())
        record[wire.AGE_SECONDS] = now - beat.wall_clock
        record[wire.PHASE_AGE_SECONDS] = now - beat.phase_started_at
        report.append(record)
    return report


def crossed_report(root: Path, ranks: list[int], last: int = CROSSED_REPORTED) -> list[int]:
    """Return the last segment boundaries rank 0 recorded crossing (only its node has any)."""
    if 0 not in ranks:
        return []
    try:
        lines = (root / BOUNDARIES_FILE).read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line being written
    return steps[-last:]


class AgentServer:
    """Serve one node agent's channel from a daemon thread."""

    def __init__(self, agent: Served, host: str, port: int) -> None:
        self.agent = agent
        handler = type("Handler", (_Handler,), {"agent": agent, "claim": _Claim()})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        serve_tls(self.httpd, server_context_from_env())  # TLS iff the pod names a cert and key
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="channel",
                                        args=(SERVE_POLL_SECONDS,), daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        """Return the (host, port) it listens on."""
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> AgentServer:
        """Start serving (once)."""
        if self._thread.is_alive():
            return self
        self._thread.start()
        log.info("channel: serving %s on %s:%d", self.agent.attempt_id, *self.address)
        return self

    def close(self) -> None:
        """Stop serving (if it started) and free the port."""
        if self._thread.is_alive():
            self.httpd.shutdown()  # waits for serve_forever: only once it runs
        self.httpd.server_close()


class _Claim:
    """The first claimer of this agent's attempt (one per server; fenced by attempt)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: str | None = None
        self.at: float | None = None

    def take(self, by: str) -> dict[str, Any]:
        with self.lock:
            if self.holder is None:
                self.holder, self.at = by, node_clock()
                log.info("channel: attempt claimed by %s", by)
            return {wire.GRANTED: self.holder == by, wire.HOLDER: self.holder}


class _Handler(BaseHTTPRequestHandler):
    agent: Served
    claim: _Claim
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002, ANN401
        log.debug("channel: %s", format % args)

    # -- plumbing ---------------------------------------------------------------------

    def _reply(self, code: int, payload: dict[str, Any] | bytes) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        kind = "application/octet-stream" if isinstance(payload, bytes) else "application/json"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _mine(self, asked: object) -> bool:
        """Answer 409 (and say so) unless the request is for this agent's attempt."""
        if asked == self.agent.attempt_id:
            return True
        log.warning("channel: refused a request for attempt %r (this agent serves %r)", asked,
                    self.agent.attempt_id)
        self._reply(409, {wire.ATTEMPT: self.agent.attempt_id, wire.NODE: self.agent.node,
                          wire.ERROR: f"this agent serves attempt {self.agent.attempt_id!r}, "
                                   f"not {asked!r}"})
        return False

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        route = {Route.STATUS: self._status, Route.RESCUE: self._rescue_state,
                 Route.RESCUE_FILE: self._rescue_file, Route.STACKS: self._stacks}
        handler = {route_path(r): h for r, h in route.items()}.get(url.path)
        if handler is None:
            self._reply(404, {wire.ERROR: f"no such path {url.path}"})
        elif handler == self._status or self._mine(query.get(wire.ATTEMPT)):
            # Status is answered whoever asks: it names its attempt, and Relay refuses a
            # stale one's heartbeats itself (and records that it did).
            self._answer(handler, query)

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(min(length, MAX_BODY_BYTES)) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("expected a JSON object")
        except ValueError as exc:
            self._reply(400, {wire.ERROR: f"bad request body: {exc}"})
            return
        route = {Route.STOP: self._stop, Route.DRAIN: self._drain, Route.RESCUE: self._rescue,
                 Route.STACKS: self._ask_stacks, Route.STACKS_SIGNAL: self._signal_stacks,
                 Route.CLAIM: self._claim, Route.STANDBY: self._standby}
        handler = {route_path(r): h for r, h in route.items()}.get(url.path)
        if handler is None:
            self._reply(404, {wire.ERROR: f"no such path {url.path}"})
        elif self._mine(body.get(wire.ATTEMPT)):
            self._answer(handler, body)

    def _answer(self, handler: Any, args: dict[str, Any]) -> None:  # noqa: ANN401
        try:
            result = handler(args)
        except (KeyError, TypeError, ValueError) as exc:
            self._reply(400, {wire.ATTEMPT: self.agent.attempt_id, wire.ERROR: repr(exc)})
            return
        except OSError as exc:
            self._reply(500, {wire.ATTEMPT: self.agent.attempt_id, wire.ERROR: repr(exc)})
            return
        if isinstance(result, bytes):
            self._reply(200, result)
        else:
            self._reply(200, {wire.ATTEMPT: self.agent.attempt_id, wire.NODE: self.agent.node,
                              **result})

    # -- the routes ------------------------------------------------------------------

    def _status(self, _query: dict[str, Any]) -> dict[str, Any]:
        now = node_clock()
        beats = heartbeat_report(self.agent.root / "heartbeats", self.agent.ranks, now)
        crossed = crossed_report(self.agent.root, self.agent.ranks)
        return {**self.agent.status_record(), wire.HEARTBEATS: beats, wire.CROSSED: crossed}

    def _stop(self, body: dict[str, Any]) -> dict[str, Any]:
        self.agent.request_stop(str(body.get(wire.REASON) or "Relay asked over the channel"))
        return {wire.STOPPING: True}

    def _standby(self, body: dict[str, Any]) -> dict[str, Any]:
        directory = Path(str(body[wire.DIRECTORY]))
        if not directory.is_absolute():
            raise ValueError(f"standby: expected an absolute directory, found {directory}")
        pid = self.agent.request_standby(directory, float(body[wire.TTL]),
                                         float(body.get(wire.LINGER) or 0.0))
        if pid is None:
            raise OSError("this agent cannot fork a standby now (it is stopping)")
        return {wire.PID: pid}

    def _claim(self, body: dict[str, Any]) -> dict[str, Any]:
        by = body[wire.BY]
        if not isinstance(by, str) or not by:
            raise ValueError(f"claim: expected a non-empty string {wire.BY!r}, found {by!r}")
        return self.claim.take(by)

    def _drain(self, body: dict[str, Any]) -> dict[str, Any]:
        stop_at = int(body[wire.STOP_AT])
        write_atomically(self.agent.root / DRAIN_FILE, json.dumps({wire.STOP_AT: stop_at}))
        return {wire.STOP_AT: stop_at}

    def _rescue(self, body: dict[str, Any]) -> dict[str, Any]:
        rank = int(body[wire.RANK])
        if rank not in self.agent.ranks:
            raise ValueError(f"rank {rank} is not on node {self.agent.node}")
        folder = self.agent.root / RESCUE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(folder / RESCUE_REQUEST, json.dumps(
            {wire.RANK: rank, wire.FAULT: body.get(wire.FAULT), "at": node_clock()}))
        return {wire.RANK: rank}

    def _rescue_state(self, _query: dict[str, Any]) -> dict[str, Any]:
        folder = self.agent.root / RESCUE_DIR
        done = None
        if (folder / DONE_FILE).exists():
            done = json.loads((folder / DONE_FILE).read_text())
        return {wire.ACK: (folder / ACK_FILE).exists(), wire.DONE: done}

    def _rescue_file(self, query: dict[str, Any]) -> bytes:
        step = int(query[wire.STEP])
        done = json.loads((self.agent.root / RESCUE_DIR / DONE_FILE).read_text())
        if done.get("step") != step or not done.get("path"):
            raise ValueError(f"no rescued state at step {step}")
        return Path(done["path"]).read_bytes()

    def _ask_stacks(self, body: dict[str, Any]) -> dict[str, Any]:
        folder = self.agent.root / EVIDENCE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        request_id = body[wire.REQUEST_ID]
        if not (folder / STACKS_REQUEST).exists() or _request_id(folder) != request_id:
            write_atomically(folder / STACKS_REQUEST, json.dumps(
                {wire.REQUEST_ID: str(request_id), wire.FAULT: body.get(wire.FAULT),
                 wire.CULPRIT_RANK: body.get(wire.CULPRIT_RANK), "at": node_clock()}))
        return {wire.REQUEST_ID: request_id}

    def _stacks(self, query: dict[str, Any]) -> dict[str, Any]:
        folder = self.agent.root / EVIDENCE_DIR
        answers, traces, pickles, fallback, exited = {}, {}, {}, {}, []
        for rank in self.agent.ranks:
            record = _read_json(answer_path(folder, rank))
            if record is not None and record.get("request") == query[wire.REQUEST_ID]:
                answers[str(rank)] = record
                trace = _read_json(trace_path(folder, rank))
                if trace is not None:
                    traces[str(rank)] = trace
                pickled = fr_dump_path(folder, rank)
                if pickled.exists():
                    pickles[str(rank)] = base64.b64encode(pickled.read_bytes()).decode()
                continue
            text = _read_text(faulthandler_path(folder, rank))
            if text.strip():
                fallback[str(rank)] = text
            if _exited(folder, rank):
                exited.append(rank)
        return {wire.ANSWERS: answers, wire.TRACES: traces, wire.FR_PICKLES: pickles,
                wire.FAULTHANDLER: fallback, wire.EXITED: exited}

    def _signal_stacks(self, _body: dict[str, Any]) -> dict[str, Any]:
        folder = self.agent.root / EVIDENCE_DIR
        signalled = []
        for rank in self.agent.ranks:
            if not answer_path(folder, rank).exists() and signal_faulthandler(folder, rank):
                signalled.append(rank)
        return {wire.SIGNALLED: signalled}


def signal_faulthandler(folder: Path, rank: int) -> bool:
    """Ask a silent rank's faulthandler for its stacks: only an armed, living process.

    The armed record names the rank's pid and its start time; a pid whose process
    started at another time is someone else's now, and SIGUSR2's default action kills.
    """
    armed = _read_json(armed_path(folder, rank))
    if armed is None or armed.get("started") is None or _exited(folder, rank):
        return False
    try:
        return signal_process(int(armed["pid"]), int(armed["started"]), int(armed["signal"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _request_id(folder: Path) -> object:
    record = _read_json(folder / STACKS_REQUEST)
    return None if record is None else record.get(wire.REQUEST_ID)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _exited(folder: Path, rank: int) -> bool:
    """Return whether an armed rank of this node has exited (it can answer nothing)."""
    armed = _read_json(armed_path(folder, rank))
    if armed is None or armed.get("started") is None:
        return False
    return start_time(int(armed["pid"])) != armed["started"]
