"""Fuzz the agent's channel: whatever a stranger (or Relay) sends, never a 500, never stuck.

Property-based (hypothesis) against the real channel server on loopback: any method,
target, headers (a negative, huge or garbage ``Content-Length`` among them) and body, sent
with no credential or signed with the attempt's secret (so that the body reaches the
routes). Every request is answered (not a 500) within the client's bound, and afterwards
no handler is left holding one of the server's slots. The bounds themselves: a client
that trickles its request is hung up on by the read deadline, and a server whose every
slot is held answers the next request 503 at once, then serves again once they are gone.
"""

from __future__ import annotations

import json
import socket
import string
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from channel_harness import ATTEMPT_ID, Served, send, serve, signed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay_train.agent import limits
from relay_train.protocol import routes as wire
from relay_train.protocol.channel_auth import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIME_HEADER,
    sign,
)
from relay_train.protocol.routes import ATTEMPT, MAX_BODY_BYTES, Route, route_path

CLIENT_BOUND_SECONDS = 60.0  # far above the server's own bounds (its read deadline: 20 s)

_SAFE = string.ascii_letters + string.digits + "-._~%/?=&+:;,!*'()[]@$"
_VALUE = "".join(c for c in string.printable if c not in "\r\n\x0b\x0c")
_FIELDS = [ATTEMPT, wire.STOP_AT, wire.RANK, wire.FAULT, wire.REQUEST_ID, wire.CULPRIT_RANK,
           wire.BY, wire.DIRECTORY, wire.TTL, wire.LINGER, wire.REASON, wire.STEP]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
    | st.text(max_size=40) | st.just(ATTEMPT_ID) | st.just("/tmp") | st.just("../../.."),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
bodies = st.one_of(
    st.binary(max_size=512),
    st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=6).map(
        lambda d: json.dumps(d).encode()),
    st.builds(lambda d: json.dumps({ATTEMPT: ATTEMPT_ID, **d}).encode(),
              st.dictionaries(st.sampled_from(_FIELDS), json_values, max_size=6)),
)
targets = st.one_of(
    st.sampled_from([route_path(r) for r in Route]).flatmap(lambda p: st.sampled_from([
        p, f"{p}?{ATTEMPT}={ATTEMPT_ID}", f"{p}?{ATTEMPT}={ATTEMPT_ID}&{wire.STEP}=1",
        f"{p}?{ATTEMPT}={ATTEMPT_ID}&{wire.REQUEST_ID}=x&{wire.STEP}=nan"])),
    st.text(alphabet=_SAFE, min_size=1, max_size=80).map(lambda t: "/" + t),
)
header_names = st.sampled_from(["Content-Length", "Transfer-Encoding", "Content-Type",
                                TIME_HEADER, NONCE_HEADER, SIGNATURE_HEADER, "Connection",
                                "Expect"]) | st.from_regex(r"X-[A-Za-z]{1,12}", fullmatch=True)
header_values = st.one_of(
    st.text(alphabet=_VALUE, max_size=120),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(["-1", "-0", "+5", " 7", "1e3", "0x10", "9" * 30, str(MAX_BODY_BYTES + 1),
                     "chunked", "nan", "inf", "100-continue"]),
)
headers = st.dictionaries(header_names, header_values, max_size=5)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    found = serve(tmp_path_factory.mktemp("fuzz") / ATTEMPT_ID)
    (found.agent.root.parent / "standby").mkdir(parents=True, exist_ok=True)
    yield found
    found.server.close()


def _never_waits_for_missing_body(given_headers: dict[str, str], body: bytes) -> dict[str, str]:
    """A Content-Length that is a count above the body's size makes the server wait for bytes
    that never come: that is the read deadline's test, below, not the fuzz's."""
    fixed = {}
    for name, value in given_headers.items():
        raw = value.strip()
        if name.lower() == "content-length" and raw.isascii() and raw.isdigit() \
                and len(body) < int(raw) <= MAX_BODY_BYTES:
            value = str(len(body))
        fixed[name] = value
    return fixed


def _slots_free(served: Served) -> bool:
    """Wait until every handler slot is back (each handler thread ends after its reply)."""
    done = threading.Event()
    for _ in range(600):
        if served.server.httpd.slots._value == limits.MAX_HANDLERS:  # type: ignore[attr-defined]
            return True
        done.wait(0.1)
    return False


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"]),
       target=targets, given_headers=headers, body=bodies, with_credential=st.booleans())
def test_whatever_is_sent_the_agent_answers_and_never_with_500(
    served: Served, method: str, target: str, given_headers: dict[str, str], body: bytes,
    with_credential: bool,
) -> None:
    if with_credential:
        given_headers = {k: v for k, v in given_headers.items()
                         if k.lower() not in ("content-length", "transfer-encoding")}
        given_headers.update(sign(served.secret, method, target, body))
    sent = _never_waits_for_missing_body(given_headers, body)
    reply = send(served.port, method, target, body, sent, timeout=CLIENT_BOUND_SECONDS)
    assert reply.code != 500, (reply, reply.body[:300])
    assert 200 <= reply.code < 600
    if reply.code == 401:
        assert ATTEMPT_ID.split("/")[0].encode() not in reply.body


def test_after_the_fuzz_no_handler_is_left_holding_a_slot(served: Served) -> None:
    assert _slots_free(served)
    status = signed(served.port, served.secret, "GET",
                    f"{route_path(Route.STATUS)}?{ATTEMPT}={ATTEMPT_ID}")
    assert status.code == 200


def _trickle(port: int) -> socket.socket:
    """Open a connection that sends the start of a request and then nothing."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(b"POST /v1/stop HTTP/1.1\r\nContent-Length: 10\r\n\r\n{")
    conn.settimeout(CLIENT_BOUND_SECONDS)
    return conn


def test_a_client_that_trickles_its_request_is_hung_up_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "READ_DEADLINE_SECONDS", 1.0)
    found = serve(tmp_path / ATTEMPT_ID)
    try:
        conn = _trickle(found.port)
        with conn:
            assert conn.recv(1024) == b""  # hung up on: EOF, long before the client's bound
        assert _slots_free(found)
        assert found.agent.stops == []
    finally:
        found.server.close()


def test_with_every_slot_held_the_next_request_gets_503_then_the_server_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = serve(tmp_path / ATTEMPT_ID, max_handlers=2)
    held: list[socket.socket] = []
    try:
        held = [_trickle(found.port) for _ in range(2)]
        status = f"{route_path(Route.STATUS)}?{ATTEMPT}={ATTEMPT_ID}"
        busy: dict[str, Any] = {}
        for _ in range(600):  # until both trickling connections hold their slots
            reply = signed(found.port, found.secret, "GET", status)
            if reply.code == 503:
                busy["reply"] = reply
                break
            threading.Event().wait(0.05)
        assert busy, "the server never said it was busy with every slot held"
        for conn in held:
            conn.close()
        assert _slots_free_of(found, 2)
        assert signed(found.port, found.secret, "GET", status).code == 200
    finally:
        for conn in held:
            conn.close()
        found.server.close()


def _slots_free_of(served: Served, count: int) -> bool:
    done = threading.Event()
    for _ in range(600):
        if served.server.httpd.slots._value == count:  # type: ignore[attr-defined]
            return True
        done.wait(0.1)
    return False


@pytest.mark.parametrize("length", ["-1", "-99999", "abc", "1e3", "9" * 40,
                                    str(MAX_BODY_BYTES + 1)])
def test_a_bad_content_length_is_refused_unread_without_a_credential(
    served: Served, length: str
) -> None:
    before = list(served.agent.stops)  # the fuzz above may have stopped it with a credential
    reply = send(served.port, "POST", route_path(Route.STOP), b"", {"Content-Length": length},
                 timeout=CLIENT_BOUND_SECONDS)
    assert reply.code in (400, 413), reply
    assert served.agent.stops == before, "a refused request had an effect"
