"""A real node agent's channel server on loopback, over an agent that records every effect.

The server is the real :class:`relay_train.agent.server.AgentServer`; only the agent
behind it is a recorder (no ranks are forked), so a test can tell whether a request had
any effect: a stop, a standby, a claim, or a file written in the attempt's folder.
"""

from __future__ import annotations

import http.client
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay_train.agent.server import AgentServer
from relay_train.protocol.channel_auth import new_secret, sign
from relay_train.protocol.routes import ATTEMPT, STATE, NodeState

ATTEMPT_ID = "secret_dag/run-7/segment-003/try-2"


@dataclass
class RecordingAgent:
    """Just enough of a node agent to serve; records what the channel asked of it."""

    root: Path
    node: str = "node-a"
    attempt_id: str = ATTEMPT_ID
    ranks: list[int] = field(default_factory=lambda: [0, 1])
    stops: list[str] = field(default_factory=list)
    standbys: list[tuple[Path, float, float]] = field(default_factory=list)

    def status_record(self) -> dict[str, Any]:
        return {STATE: NodeState.RUNNING}

    def request_stop(self, reason: str) -> None:
        self.stops.append(reason)

    def request_standby(self, directory: Path, ttl: float, linger: float) -> int | None:
        self.standbys.append((directory, ttl, linger))
        return 4242


@dataclass
class Served:
    """One agent and its server."""

    agent: RecordingAgent
    server: AgentServer
    secret: str

    @property
    def port(self) -> int:
        return self.server.address[1]

    def files(self) -> dict[str, bytes]:
        """Return every file under the attempt's folder (what a request could have written)."""
        found = {}
        for folder, _dirs, names in os.walk(self.agent.root):
            for name in names:
                path = Path(folder) / name
                found[str(path.relative_to(self.agent.root))] = path.read_bytes()
        return found


def serve(root: Path, **server_args: Any) -> Served:  # noqa: ANN401
    """Start a channel server over a recording agent of attempt :data:`ATTEMPT_ID` at ``root``."""
    (root / "heartbeats").mkdir(parents=True, exist_ok=True)
    agent = RecordingAgent(root)
    secret = new_secret()
    server = AgentServer(agent, "127.0.0.1", 0, secret=secret, **server_args).start()
    return Served(agent, server, secret)


@dataclass
class Reply:
    code: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict[str, Any]:
        return json.loads(self.body)


def send(port: int, method: str, target: str, body: bytes = b"",
         headers: dict[str, str] | None = None, timeout: float = 60.0) -> Reply:
    """Send one request as given (any headers, any body); return the reply."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, target, skip_accept_encoding=True)
        given = {k.lower() for k in (headers or {})}
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if "content-length" not in given and (body or method == "POST"):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        reply = conn.getresponse()
        return Reply(reply.status, {k: v for k, v in reply.getheaders()}, reply.read())
    finally:
        conn.close()


def signed(port: int, secret: str, method: str, target: str, body: bytes = b"") -> Reply:
    """Send one request signed with ``secret``."""
    return send(port, method, target, body, sign(secret, method, target, body))


def attempt_body(**fields: Any) -> bytes:  # noqa: ANN401
    """Return a JSON request body naming the served attempt."""
    return json.dumps({ATTEMPT: ATTEMPT_ID, **fields}).encode()
