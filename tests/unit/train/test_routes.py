"""The channel's routes and node states: one spelling, served by the agent."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relay_train.agent.server import AgentServer
from relay_train.protocol.channel_auth import new_secret, sign
from relay_train.protocol.routes import (
    API_PREFIX,
    ATTEMPT,
    ERROR,
    SETTLED,
    STATE,
    NodeState,
    Route,
    route_path,
)


class _Agent:
    """Just enough of a node agent for its server to answer."""

    node = "node-a"
    attempt_id = "dag/run/segment-000/try-1"
    ranks = [0]

    def __init__(self, root: Path) -> None:
        self.root = root

    def status_record(self) -> dict[str, Any]:
        return {STATE: NodeState.RUNNING}

    def request_stop(self, reason: str) -> None:
        pass

    def request_standby(self, directory: Path, ttl: float, linger: float) -> int | None:
        return None


def test_the_wire_spells_routes_and_states_as_before() -> None:
    # What agents of an earlier install and Relay already exchange: never renamed by accident.
    assert {route_path(r) for r in Route} == {
        "/v1/status", "/v1/stop", "/v1/drain", "/v1/rescue", "/v1/rescue/file", "/v1/stacks",
        "/v1/stacks/signal", "/v1/claim", "/v1/standby", "/v1/summary"}
    assert [s.value for s in NodeState] == [
        "starting", "running", "succeeded", "failed", "unresponsive"]
    assert SETTLED == {"succeeded", "failed"}


SECRET = new_secret()


def _ask(base: str, route: Route, method: str) -> tuple[int, dict[str, Any]]:
    data = json.dumps({ATTEMPT: "someone else's"}).encode() if method == "POST" else None
    target = f"{route_path(route)}?{ATTEMPT}=x"
    request = urllib.request.Request(f"{base}{target}", data=data, method=method,
                                     headers=sign(SECRET, method, target, data or b""))
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:  # noqa: S310 - loopback
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def base(tmp_path: Path) -> Iterator[str]:
    server = AgentServer(_Agent(tmp_path), "127.0.0.1", 0, secret=SECRET).start()
    try:
        yield "http://{}:{}".format(*server.address)
    finally:
        server.close()


@pytest.mark.parametrize("route", list(Route))
def test_the_agent_serves_every_route_the_protocol_names(base: str, route: Route) -> None:
    answers = {m: _ask(base, route, m) for m in ("GET", "POST")}
    # Served: answered, or refused for naming another attempt (409), never "no such path".
    served = {m: code for m, (code, _) in answers.items() if code != 404}
    assert served, f"{route_path(route)}: 404 to GET and POST: {answers}"
    assert all(code in (200, 409) for code in served.values()), answers


def test_a_route_asked_the_wrong_way_is_no_such_path(base: str) -> None:
    code, answer = _ask(base, Route.STATUS, "POST")  # status is GET only
    assert code == 404 and answer[ERROR] == f"no such path {API_PREFIX}/status"
