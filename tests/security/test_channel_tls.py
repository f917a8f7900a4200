"""TLS on the channel where it crosses hosts: real agent servers, real TLS, on 127.0.0.1.

A throwaway channel CA signs the agent's certificate for ``relay-agent`` (the name
Relay checks, whatever address it dialled); another CA, and a certificate of the
channel CA for another name, stand for what a stranger could present. Everything
on the wire is the real agent server (relay_train.agent.server) and Relay's real
channel client (relay.launchers.agent_client).
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from agents import ServedNode
from channel_certs import Authority, new_authority

from relay.core.attempt import Attempt
from relay.launchers.agent_client import AgentChannel
from relay.launchers.local.launcher import LocalLauncher
from relay_train.agent.server import AgentServer
from relay_train.protocol.channel_auth import new_secret
from relay_train.protocol.channel_tls import (
    AGENT_TLS_NAME,
    client_context,
    server_context_from_env,
)
from relay_train.protocol.env import ENV_CHANNEL_TLS_CERT, ENV_CHANNEL_TLS_KEY
from relay_train.protocol.launch import LAUNCH_FILE, LaunchConfig
from relay_train.protocol.routes import STATE, STOPPING, NodeState, Route, route_path

ATTEMPT = "relay_demo/run/segment-001/try-0"
SECRET = new_secret()  # the attempt's channel secret: TLS comes on top of it


@pytest.fixture(scope="module")
def channel_ca() -> Authority:
    return new_authority("relay channel CA (test)")


@pytest.fixture
def served(tmp_path: Path) -> ServedNode:
    (tmp_path / "heartbeats").mkdir()
    return ServedNode(tmp_path, "node-a", [0, 1], ATTEMPT)


def start_tls_agent(monkeypatch: pytest.MonkeyPatch, node: ServedNode, cert: Path,
                    key: Path) -> AgentServer:
    """Start a real agent server told (by its environment, as in a pod) to serve TLS."""
    monkeypatch.setenv(ENV_CHANNEL_TLS_CERT, str(cert))
    monkeypatch.setenv(ENV_CHANNEL_TLS_KEY, str(key))
    return AgentServer(node, "127.0.0.1", 0, secret=SECRET).start()


@pytest.fixture
def tls_agent(monkeypatch: pytest.MonkeyPatch, served: ServedNode, channel_ca: Authority,
              tmp_path: Path) -> Iterator[AgentServer]:
    server = start_tls_agent(monkeypatch, served, *channel_ca.issue(tmp_path / "pki",
                                                                    AGENT_TLS_NAME))
    yield server
    server.close()


def https(server: AgentServer) -> str:
    return "https://{}:{}".format(*server.address)


def test_relay_talks_to_a_tls_agent_it_verifies_by_the_channel_ca(
    tls_agent: AgentServer, served: ServedNode, channel_ca: Authority
) -> None:
    channel = AgentChannel(ATTEMPT, {"node-a": https(tls_agent)}, SECRET,
                           tls=client_context(channel_ca.pem))

    replies = channel.poll()

    assert replies["node-a"] is not None, "no status over TLS"
    assert replies["node-a"].record[STATE] == NodeState.RUNNING
    assert channel.ask("node-a", Route.STOP, reason="test") == {
        "attempt": ATTEMPT, "node": "node-a", STOPPING: True}
    assert served.stop_reasons == ["test"]


def test_a_client_without_the_channel_ca_is_refused(
    tls_agent: AgentServer, served: ServedNode
) -> None:
    # The system's CAs (what any client has) do not vouch for the agent: no handshake.
    stranger = ssl.create_default_context()
    with pytest.raises(urllib.error.URLError) as refused:
        urllib.request.urlopen(f"{https(tls_agent)}{route_path(Route.STATUS)}", timeout=30,
                               context=stranger)
    assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)
    channel = AgentChannel(ATTEMPT, {"node-a": https(tls_agent)}, SECRET, tls=stranger)
    assert channel.ask("node-a", Route.STOP, reason="a stranger") is None
    assert served.stop_reasons == []


def test_an_agent_with_a_certificate_from_another_ca_is_refused(
    monkeypatch: pytest.MonkeyPatch, served: ServedNode, channel_ca: Authority, tmp_path: Path,
    caplog: pytest.LogCaptureFixture
) -> None:
    impostor_ca = new_authority("someone else's CA")
    server = start_tls_agent(monkeypatch, served,
                             *impostor_ca.issue(tmp_path / "impostor", AGENT_TLS_NAME))
    try:
        channel = AgentChannel(ATTEMPT, {"node-a": https(server)}, SECRET,
                               tls=client_context(channel_ca.pem))
        with caplog.at_level(logging.WARNING, logger="relay.launchers.agent_client"):
            assert channel.poll()["node-a"] is None
            assert channel.ask("node-a", Route.STOP, reason="to an impostor") is None
        assert "node-a" not in channel.reports
        warned = [r for r in caplog.records if "TLS with the agent of node-a" in r.getMessage()]
        assert len(warned) == 1, "expected one warning naming the node, not one per request"
        assert "certificate verify failed" in warned[0].getMessage()
    finally:
        server.close()


def test_a_certificate_of_the_channel_ca_for_another_name_is_refused(
    monkeypatch: pytest.MonkeyPatch, served: ServedNode, channel_ca: Authority, tmp_path: Path
) -> None:
    server = start_tls_agent(monkeypatch, served,
                             *channel_ca.issue(tmp_path / "other", "not-an-agent.example"))
    try:
        with pytest.raises(urllib.error.URLError) as refused:
            urllib.request.urlopen(f"{https(server)}{route_path(Route.STATUS)}", timeout=30,
                                   context=client_context(channel_ca.pem))
        assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)
        assert AGENT_TLS_NAME in str(refused.value.reason)
    finally:
        server.close()


def test_clear_text_http_to_a_tls_agent_gets_nothing(
    tls_agent: AgentServer, served: ServedNode, channel_ca: Authority,
    caplog: pytest.LogCaptureFixture
) -> None:
    host, port = tls_agent.address
    body = b'{"attempt": "%s", "reason": "clear text"}' % ATTEMPT.encode()
    request = (b"POST /v1/stop HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with caplog.at_level(logging.WARNING, logger="relay_train.protocol.channel_tls"), \
            socket.create_connection((host, port), timeout=30) as plain:
        plain.sendall(request)
        answer = b""
        while chunk := plain.recv(4096):  # the agent hangs up
            answer += chunk
    assert b"HTTP/" not in answer and ATTEMPT.encode() not in answer
    assert served.stop_reasons == []
    assert any("no TLS handshake" in r.getMessage() for r in caplog.records)
    clear = AgentChannel(ATTEMPT, {"node-a": f"http://{host}:{port}"}, SECRET)
    assert clear.poll()["node-a"] is None
    # The agent still serves Relay over TLS afterwards.
    assert AgentChannel(ATTEMPT, {"node-a": https(tls_agent)}, SECRET,
                        tls=client_context(channel_ca.pem)).poll()["node-a"] is not None


def test_a_silent_connection_does_not_hold_up_relays_requests(
    tls_agent: AgentServer, channel_ca: Authority
) -> None:
    # A stranger connects and says nothing: its handshake waits in its own thread, not in the
    # loop that accepts Relay's connection.
    with socket.create_connection(tls_agent.address, timeout=30):
        channel = AgentChannel(ATTEMPT, {"node-a": https(tls_agent)}, SECRET,
                               tls=client_context(channel_ca.pem))
        reply = channel.call("node-a", Route.STATUS, timeout=30)
    assert isinstance(reply, dict) and reply[STATE] == NodeState.RUNNING


def test_the_agents_tls_settings_are_checked_before_it_serves(
    channel_ca: Authority, tmp_path: Path
) -> None:
    cert, key = channel_ca.issue(tmp_path / "pki", AGENT_TLS_NAME)
    assert server_context_from_env({}) is None  # neither: clear text
    assert server_context_from_env({ENV_CHANNEL_TLS_CERT: str(cert),
                                    ENV_CHANNEL_TLS_KEY: str(key)}) is not None
    with pytest.raises(ValueError, match=f"expected both {ENV_CHANNEL_TLS_CERT} and "
                       f"{ENV_CHANNEL_TLS_KEY}, found only {ENV_CHANNEL_TLS_CERT}"):
        server_context_from_env({ENV_CHANNEL_TLS_CERT: str(cert)})
    with pytest.raises(ValueError, match="expected readable files .*No such file"):
        server_context_from_env({ENV_CHANNEL_TLS_CERT: str(cert),
                                 ENV_CHANNEL_TLS_KEY: str(tmp_path / "missing.key")})
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key\n")
    with pytest.raises(ValueError, match="do not load as a matching pair"):
        server_context_from_env({ENV_CHANNEL_TLS_CERT: str(cert),
                                 ENV_CHANNEL_TLS_KEY: str(garbage)})
    with pytest.raises(ValueError, match="expected the channel CA as PEM text"):
        client_context("not a certificate")


def test_an_agent_told_to_serve_tls_without_its_key_refuses_to_start(
    channel_ca: Authority, tmp_path: Path
) -> None:
    cert, _key = channel_ca.issue(tmp_path / "pki", AGENT_TLS_NAME)
    env = {**os.environ, ENV_CHANNEL_TLS_CERT: str(cert),
           ENV_CHANNEL_TLS_KEY: str(tmp_path / "pki" / "gone.key")}
    agent = subprocess.run(
        [sys.executable, "-m", "relay_train.agent.node", "--launch", str(tmp_path / "launch.json"),
         "--node", "node-a"], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert agent.returncode == 2, agent.stderr
    assert "channel TLS: expected readable files" in agent.stderr
    assert "gone.key" in agent.stderr and "Traceback" not in agent.stderr


def test_local_launches_stay_clear_text(tmp_path: Path, served: ServedNode,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CHANNEL_TLS_CERT, raising=False)
    monkeypatch.delenv(ENV_CHANNEL_TLS_KEY, raising=False)
    server = AgentServer(served, "127.0.0.1", 0, secret=SECRET).start()  # as a local agent
    try:
        launcher = LocalLauncher()
        attempt = Attempt(tmp_path / "runs" / "relay_demo" / "run" / "segment-001" / "try-0")
        attempt.runs_in.mkdir(parents=True)
        LaunchConfig(  # the launch file the local launcher wrote: its channel secret
            job="j", seed=1, model={}, data={}, optimizer={}, start_step=0, end_step=1,
            checkpoint_every=1, nodes=["node-a"], ranks_per_node=1, tracking_uri="sqlite:///x",
            run_id="r", attempt_dir=str(attempt.runs_in), attempt=0, segment=1,
            channel_secret=SECRET).write(attempt.runs_in / LAUNCH_FILE)
        pid = os.getpid()
        launcher.attach(attempt, {"attempt_id": ATTEMPT, "started_at": 0.0, "nodes": {
            "node-a": {"pid": pid, "pgid": os.getpgid(pid), "started": None,
                       "port": server.address[1]}}})
        channel = launcher.channel(attempt)
        assert channel.tls is None
        assert channel.addresses == {"node-a": f"http://127.0.0.1:{server.address[1]}"}
        assert channel.poll()["node-a"] is not None, "a local agent answers in clear text"
    finally:
        server.close()
