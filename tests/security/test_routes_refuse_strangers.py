"""Every agent route, status included, answers only the attempt's credential.

A real channel server on loopback over an agent that records every effect: each route,
asked without a credential, with another secret, with a tampered body, a stale time or a
replayed request, gets 401, a body that names nothing, and has no effect. The control
requests signed with the attempt's secret are answered, and signed back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from channel_harness import (
    ATTEMPT_ID,
    Reply,
    Served,
    attempt_body,
    send,
    serve,
    signed,
)

from relay_train.protocol.channel_auth import (
    NONCE_HEADER,
    REPLAY_WINDOW_SECONDS,
    REPLY_HEADER,
    SIGNATURE_HEADER,
    TIME_HEADER,
    Verifier,
    new_secret,
    reply_is_signed,
    sign,
)
from relay_train.protocol.routes import (
    ATTEMPT,
    BY,
    DIRECTORY,
    ERROR,
    GRANTED,
    LINGER,
    RANK,
    REQUEST_ID,
    STEP,
    STOP_AT,
    TTL,
    Route,
    route_path,
)


@pytest.fixture
def served(tmp_path: Path) -> Served:
    found = serve(tmp_path / ATTEMPT_ID)
    yield found  # type: ignore[misc]
    found.server.close()


def _requests(served: Served) -> list[tuple[str, str, bytes]]:
    """Return one request of each route and method the agent serves, naming the attempt."""
    standby = served.agent.root.parent / "standby"
    query = f"?{ATTEMPT}={ATTEMPT_ID}"
    gets = [(Route.STATUS, ""), (Route.RESCUE, ""), (Route.RESCUE_FILE, f"&{STEP}=5"),
            (Route.STACKS, f"&{REQUEST_ID}=r1")]
    posts = {Route.STOP: {}, Route.DRAIN: {STOP_AT: 10}, Route.RESCUE: {RANK: 0},
             Route.STACKS: {REQUEST_ID: "r1"}, Route.STACKS_SIGNAL: {REQUEST_ID: "r1"},
             Route.CLAIM: {BY: "stranger"},
             Route.STANDBY: {DIRECTORY: str(standby), TTL: 60, LINGER: 0}}
    return ([("GET", f"{route_path(r)}{query}{extra}", b"") for r, extra in gets]
            + [("POST", f"{route_path(r)}{query}", attempt_body(**b)) for r, b in posts.items()])


def _no_credential(served: Served, method: str, target: str, body: bytes) -> Reply:
    return send(served.port, method, target, body)


def _another_secret(served: Served, method: str, target: str, body: bytes) -> Reply:
    return signed(served.port, new_secret(), method, target, body)


def _tampered_body(served: Served, method: str, target: str, body: bytes) -> Reply:
    headers = sign(served.secret, method, target, body)
    return send(served.port, method, target, body + b" " if body else b"{}", headers)


def _another_target(served: Served, method: str, target: str, body: bytes) -> Reply:
    headers = sign(served.secret, method, route_path(Route.STATUS), body)
    return send(served.port, method, target, body, headers)


def _stale(served: Served, method: str, target: str, body: bytes) -> Reply:
    then = time.time() - 2 * REPLAY_WINDOW_SECONDS
    return send(served.port, method, target, body, sign(served.secret, method, target, body, then))


def _garbled_signature(served: Served, method: str, target: str, body: bytes) -> Reply:
    headers = sign(served.secret, method, target, body)
    headers[SIGNATURE_HEADER] = headers[SIGNATURE_HEADER][::-1]
    return send(served.port, method, target, body, headers)


STRANGERS: list[Callable[[Served, str, str, bytes], Reply]] = [
    _no_credential, _another_secret, _tampered_body, _another_target, _stale,
    _garbled_signature]


def _refused_naming_nothing(reply: Reply) -> None:
    assert reply.code == 401, reply
    assert reply.json() == {ERROR: "unauthorized"}
    assert REPLY_HEADER not in reply.headers
    told = reply.body.decode() + json.dumps(reply.headers)
    for secret_part in ATTEMPT_ID.split("/"):
        assert secret_part not in told


@pytest.mark.parametrize("stranger", STRANGERS, ids=lambda f: f.__name__.strip("_"))
def test_every_route_refuses_a_request_without_the_attempts_credential(
    served: Served, stranger: Callable[[Served, str, str, bytes], Reply]
) -> None:
    before = served.files()
    for method, target, body in _requests(served):
        _refused_naming_nothing(stranger(served, method, target, body))
    # No effect: nothing stopped, forked, claimed or written.
    assert served.agent.stops == [] and served.agent.standbys == []
    assert served.files() == before
    claim = signed(served.port, served.secret, "POST", f"{route_path(Route.CLAIM)}",
                   attempt_body(**{BY: "relay"}))
    assert claim.code == 200 and claim.json()[GRANTED] is True  # nobody claimed before


def test_a_replayed_request_is_refused_and_has_no_second_effect(served: Served) -> None:
    target, body = route_path(Route.STOP), attempt_body()
    headers = sign(served.secret, "POST", target, body)
    assert send(served.port, "POST", target, body, headers).code == 200
    _refused_naming_nothing(send(served.port, "POST", target, body, headers))
    assert len(served.agent.stops) == 1


def test_the_attempts_credential_is_answered_on_every_route_and_signed_back(
    served: Served,
) -> None:
    (served.agent.root.parent / "standby").mkdir()
    for method, target, body in _requests(served):
        headers = sign(served.secret, method, target, body)
        reply = send(served.port, method, target, body, headers)
        # Answered: 200, or 404 for the rescued file no rank wrote; never refused.
        assert reply.code in (200, 404), (target, reply)
        assert reply_is_signed(served.secret, headers[NONCE_HEADER], reply.code, reply.body,
                               reply.headers)
        assert not reply_is_signed(new_secret(), headers[NONCE_HEADER], reply.code, reply.body,
                                   reply.headers)
    assert len(served.agent.stops) == 1 and len(served.agent.standbys) == 1


@pytest.mark.parametrize("skew", [-300.0, -50.0, 50.0, 300.0])
def test_a_node_clock_off_by_minutes_is_no_stranger(served: Served, skew: float) -> None:
    target = f"{route_path(Route.STATUS)}?{ATTEMPT}={ATTEMPT_ID}"
    headers = sign(served.secret, "GET", target, b"", time.time() + skew)
    assert send(served.port, "GET", target, b"", headers).code == 200


def test_the_nonce_cache_is_bounded_and_forgets_nothing_replayable() -> None:
    verifier = Verifier("s", window_seconds=100.0, kept=4)
    now = 1000.0
    sent = [sign("s", "GET", "/v1/status", b"", now + i) for i in range(6)]
    assert all(verifier.verify("GET", "/v1/status", h, b"", now + 6) for h in sent)
    assert len(verifier._seen) <= 4
    for headers in sent:  # the ones it forgot are older than its floor: still refused
        assert verifier.verify("GET", "/v1/status", headers, b"", now + 6) is None
    fresh = sign("s", "GET", "/v1/status", b"", now + 7)
    assert verifier.verify("GET", "/v1/status", fresh, b"", now + 7)


@pytest.mark.parametrize("header", [TIME_HEADER, NONCE_HEADER, SIGNATURE_HEADER])
def test_a_request_missing_any_one_header_is_refused(served: Served, header: str) -> None:
    target = f"{route_path(Route.STATUS)}?{ATTEMPT}={ATTEMPT_ID}"
    headers = sign(served.secret, "GET", target)
    del headers[header]
    _refused_naming_nothing(send(served.port, "GET", target, b"", headers))
