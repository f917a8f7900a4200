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
- ``GET /v1/summary``: only where the served agent is an aggregator of a group of nodes
  (:mod:`relay.launchers.aggregator`): their agents' status in one signed answer;
- ``POST /v1/claim`` (``by``): who acts on this attempt's fault (Relay's
  ``execute_complete`` or its warden, maybe on different machines). The agent
  grants the first claimer and names it to every later one (``granted``,
  ``holder``); see :mod:`relay.recover.claim` for how Relay counts the answers.

Fencing: every request names its attempt (``attempt`` in the query or the body)
and every reply carries the agent's own; a request for another attempt gets
409 with the agent's attempt (status is answered anyway: Relay refuses a stale
agent's heartbeats itself, and records it). The routes, fields and node states are
spelled in :mod:`relay_train.protocol.routes`.

Trust: every route, status included, answers only a request signed with the attempt's
channel secret (:mod:`relay_train.protocol.channel_auth`); any other gets 401 with a body
that names nothing, and has no effect. Replies to a signed request are signed back. The
server bounds what a stranger can cost it: a body over ``MAX_BODY_BYTES`` (or a
``Content-Length`` that is no count) is refused unread, a connection idle for
``SOCKET_TIMEOUT_SECONDS`` is closed, one connection carries one request, and at most
``MAX_HANDLERS`` requests are handled at once (the next gets 503 at once). A standby is
forked only into a folder under the agent's DAG run folder, with a bounded ttl. Where the
agent's environment names a certificate and key (on Kubernetes), it serves TLS:
:mod:`relay_train.protocol.channel_tls`. Stdlib only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlparse

from relay_train.agent.limits import (
    MAX_HANDLERS,
    SOCKET_TIMEOUT_SECONDS,
    BoundedServer,
    Deadline,
    Refused,
    bounded_seconds,
    read_body,
    standby_home,
)
from relay_train.agent.node_files import (
    crossed_report,
    heartbeat_report,
)
from relay_train.agent.rank_requests import (
    ask_rescue,
    ask_stacks,
    rescue_state,
    rescued_file,
    signal_stacks,
    stacks_answers,
)
from relay_train.protocol import routes as wire
from relay_train.protocol.channel_auth import REPLY_HEADER as SIGNED_REPLY
from relay_train.protocol.channel_auth import UNAUTHORIZED, Verifier, reply_signature
from relay_train.protocol.channel_tls import serve_tls, server_context_from_env
from relay_train.protocol.heartbeat import node_clock, write_atomically
from relay_train.protocol.launch import DRAIN_FILE
from relay_train.protocol.routes import Route, route_path

log = logging.getLogger("relay_train.agent.server")

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


class AgentServer:
    """Serve one node agent's channel from a daemon thread."""

    def __init__(self, agent: Served, host: str, port: int, *, secret: str,
                 max_handlers: int = MAX_HANDLERS) -> None:
        """Listen on ``host:port``; answer only requests signed with ``secret``.

        TLS (when the environment names a certificate and key) wraps ``self.httpd.socket``
        here, before :meth:`start`: :func:`relay_train.protocol.channel_tls.serve_tls`.
        """
        self.agent = agent
        handler = type("Handler", (_Handler,), {"agent": agent, "claim": _Claim(),
                                                "verifier": Verifier(secret)})
        self.httpd = BoundedServer((host, port), handler, max_handlers)
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
    verifier: Verifier
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_SECONDS  # applied to the connection's socket (StreamRequestHandler)
    nonce: str | None = None  # the verified request's, to sign its reply with

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002, ANN401
        log.debug("channel: %s", format % args)

    def setup(self) -> None:
        super().setup()
        self.deadline = Deadline(self.connection)

    def finish(self) -> None:
        self.deadline.cancel()
        super().finish()

    # -- plumbing ---------------------------------------------------------------------

    def _reply(self, code: int, payload: dict[str, Any] | bytes) -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        kind = "application/octet-stream" if isinstance(payload, bytes) else "application/json"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        if self.nonce is not None:
            self.send_header(SIGNED_REPLY, reply_signature(self.verifier.secret, self.nonce,
                                                           code, body))
        self.send_header("Connection", "close")  # one request per connection: a bounded cost
        self.close_connection = True
        try:
            self.end_headers()
            self.wfile.write(body)
        except (TimeoutError, ConnectionError) as exc:  # the client left, or stopped reading
            log.info("channel: could not answer %s: %s", self.client_address[0], exc)

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

    def _authentic(self, body: bytes) -> bool:
        """Check the request's credential; answer 401 (naming nothing) if it fails."""
        self.nonce = self.verifier.verify(self.command, self.path, self.headers, body)
        if self.nonce is None:
            log.warning("channel: refused an unauthenticated %s %s from %s", self.command,
                        self.path[:200], self.client_address[0])
            self._reply(401, {wire.ERROR: UNAUTHORIZED})
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self._handle(self._get)

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self._handle(self._post)

    def _handle(self, serve: Any) -> None:  # noqa: ANN401
        """Read, authenticate and serve one request; whatever happens, answer or hang up."""
        self.nonce = None
        try:
            body = read_body(self.headers, self.rfile)
            if self._authentic(body):
                self.deadline.cancel()
                serve(body)
        except Refused as refused:
            self._reply(refused.code, {wire.ERROR: refused.error})
        except (TimeoutError, ConnectionError) as exc:  # a client too slow, or gone
            log.info("channel: dropped a request from %s: %s", self.client_address[0], exc)
            self.close_connection = True
        except Exception:  # a bug: say so, never leave the client hanging
            log.exception("channel: %s %s failed", self.command, self.path[:200])
            self._reply(500, {wire.ERROR: "internal error; see the agent's log"})

    def _get(self, _body: bytes) -> None:
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        route = {Route.STATUS: self._status, Route.RESCUE: self._rescue_state,
                 Route.RESCUE_FILE: self._rescue_file, Route.STACKS: self._stacks,
                 Route.SUMMARY: self._summary}
        handler = {route_path(r): h for r, h in route.items()}.get(url.path)
        if handler is None:
            self._reply(404, {wire.ERROR: f"no such path {url.path[:200]}"})
        elif handler == self._status or self._mine(query.get(wire.ATTEMPT)):
            # Status is answered to any signed request: it names its attempt, and Relay
            # refuses a stale one's heartbeats itself (and records that it did).
            self._answer(handler, query)

    def _post(self, raw: bytes) -> None:
        url = urlparse(self.path)
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("expected a JSON object")
        except (ValueError, RecursionError) as exc:
            self._reply(400, {wire.ERROR: f"bad request body: {str(exc)[:200]}"})
            return
        route = {Route.STOP: self._stop, Route.DRAIN: self._drain, Route.RESCUE: self._rescue,
                 Route.STACKS: self._ask_stacks, Route.STACKS_SIGNAL: self._signal_stacks,
                 Route.CLAIM: self._claim, Route.STANDBY: self._standby}
        handler = {route_path(r): h for r, h in route.items()}.get(url.path)
        if handler is None:
            self._reply(404, {wire.ERROR: f"no such path {url.path[:200]}"})
        elif self._mine(body.get(wire.ATTEMPT)):
            self._answer(handler, body)

    def _answer(self, handler: Any, args: dict[str, Any]) -> None:  # noqa: ANN401
        try:
            result = handler(args)
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            self._reply(400, {wire.ATTEMPT: self.agent.attempt_id, wire.ERROR: repr(exc)[:500]})
            return
        except FileNotFoundError as exc:
            self._reply(404, {wire.ATTEMPT: self.agent.attempt_id, wire.ERROR: repr(exc)[:500]})
            return
        except OSError as exc:  # the node cannot do it now (a full disk, a stopping agent)
            self._reply(503, {wire.ATTEMPT: self.agent.attempt_id, wire.ERROR: repr(exc)[:500]})
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

    def _summary(self, _query: dict[str, Any]) -> dict[str, Any]:
        """An aggregator's group summary (relay.launchers.aggregator); a node agent has none."""
        summary = getattr(self.agent, "summary_record", None)
        if summary is None:
            raise FileNotFoundError("this agent is no aggregator: it serves no summary")
        return dict(summary())

    def _stop(self, body: dict[str, Any]) -> dict[str, Any]:
        self.agent.request_stop(str(body.get(wire.REASON) or "Relay asked over the channel"))
        return {wire.STOPPING: True}

    def _standby(self, body: dict[str, Any]) -> dict[str, Any]:
        directory = Path(str(body[wire.DIRECTORY]))
        home = standby_home(self.agent.root)
        if not directory.is_absolute() or "\0" in str(directory) or \
                not Path(os.path.realpath(directory)).is_relative_to(home) or \
                Path(os.path.realpath(directory)) == home:
            raise ValueError(f"standby: expected an absolute folder under {home}, "
                             f"found {str(directory)[:200]}")
        ttl = bounded_seconds(body[wire.TTL], wire.TTL, wire.MAX_STANDBY_TTL_SECONDS, positive=True)
        linger = bounded_seconds(body.get(wire.LINGER) or 0.0, wire.LINGER, wire.MAX_LINGER_SECONDS)
        pid = self.agent.request_standby(directory, ttl, linger)
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

    # Rescue and stacks: handed to the ranks through node-local files (rank_requests).

    def _rescue(self, body: dict[str, Any]) -> dict[str, Any]:
        return ask_rescue(self.agent.root, self.agent.ranks, self.agent.node, body)

    def _rescue_state(self, _query: dict[str, Any]) -> dict[str, Any]:
        return rescue_state(self.agent.root)

    def _rescue_file(self, query: dict[str, Any]) -> bytes:
        return rescued_file(self.agent.root, query)

    def _ask_stacks(self, body: dict[str, Any]) -> dict[str, Any]:
        return ask_stacks(self.agent.root, body)

    def _stacks(self, query: dict[str, Any]) -> dict[str, Any]:
        return stacks_answers(self.agent.root, self.agent.ranks, query)

    def _signal_stacks(self, _body: dict[str, Any]) -> dict[str, Any]:
        return signal_stacks(self.agent.root, self.agent.ranks)
