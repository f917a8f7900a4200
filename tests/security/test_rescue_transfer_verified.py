"""A rescued state crosses the channel authenticated and is verified on arrival.

Real agent servers (``tests/agents.py``) and Relay's real channel: the rank's file is kept
only when its sha256 is the one the rank declared; otherwise it is deleted, refused and
reported (``rescued/rejected.json``). A reply altered on the way (a proxy between Relay
and the agent) is not the agent's signed word and is not used; an agent never serves a
file outside the attempt's rescue folder. (Unauthenticated requests: see
``test_routes_refuse_strangers.py``.)
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from agents import ServedAttempt

from relay.core.attempt import Attempt
from relay.recover.ask_rescue import RECEIVED_DIR, REJECTED_FILE, _fetch_state
from relay_train.protocol.manifest import CHECKPOINT_FILE
from relay_train.protocol.rescue_files import DONE_FILE, RESCUE_DIR, RescueResult

STEP = 40
STATE = b"the rank's weights and optimizer state" * 100


@pytest.fixture
def node_side(tmp_path: Path) -> Path:
    return tmp_path / "node" / "dag" / "run-1" / "segment-000" / "try-1"


@pytest.fixture
def relay_side(tmp_path: Path) -> Path:
    return tmp_path / "relay"


@pytest.fixture
def agents(node_side: Path) -> Iterator[ServedAttempt]:
    (node_side / "heartbeats").mkdir(parents=True)
    served = ServedAttempt(node_side, {"node-a": [0, 1]})
    yield served
    served.close()


def _rescued(root: Path, content: bytes, declared: bytes | None = None,
             path: Path | None = None) -> RescueResult:
    """Write what rank 0 writes when it hands over its state; return what it declares."""
    folder = root / RESCUE_DIR
    file = path or folder / f"step-{STEP:08d}" / CHECKPOINT_FILE
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_bytes(content)
    result = RescueResult(0, step=STEP, path=str(file),
                          sha256=hashlib.sha256(declared or content).hexdigest(),
                          size_bytes=len(content))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / DONE_FILE).write_text(json.dumps(result.__dict__))
    return result


def _kept(relay_side: Path) -> Path:
    return relay_side / RECEIVED_DIR / f"step-{STEP:08d}" / CHECKPOINT_FILE


def test_a_file_matching_what_the_rank_declared_is_kept(
    agents: ServedAttempt, node_side: Path, relay_side: Path
) -> None:
    result = _rescued(node_side, STATE)
    channel = agents.channel(Attempt(node_side))
    assert _fetch_state(channel, "node-a", result, relay_side, 10.0) == _kept(relay_side)
    assert _kept(relay_side).read_bytes() == STATE


def test_a_file_whose_sha256_is_not_the_declared_one_is_refused_and_reported(
    agents: ServedAttempt, node_side: Path, relay_side: Path
) -> None:
    result = _rescued(node_side, STATE, declared=b"what the rank meant to write")
    channel = agents.channel(Attempt(node_side))
    assert _fetch_state(channel, "node-a", result, relay_side, 10.0) is None
    assert not _kept(relay_side).exists()
    assert not _kept(relay_side).with_suffix(".partial").exists()
    report = json.loads((relay_side / RECEIVED_DIR / REJECTED_FILE).read_text())
    assert report["expected_sha256"] == result.sha256
    assert report["found_sha256"] == hashlib.sha256(STATE).hexdigest()
    assert (report["node"], report["rank"], report["step"]) == ("node-a", 0, STEP)


def test_an_agent_serves_no_file_outside_the_attempts_rescue_folder(
    agents: ServedAttempt, node_side: Path, relay_side: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "not-a-rescue" / "keys.pem"
    result = _rescued(node_side, b"private", path=secret)
    channel = agents.channel(Attempt(node_side))
    assert _fetch_state(channel, "node-a", result, relay_side, 10.0) is None
    assert not _kept(relay_side).exists()


class _Tamperer(BaseHTTPRequestHandler):
    """Forward a GET to the agent and flip one byte of its answer (headers kept)."""

    upstream = ""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        request = urllib.request.Request(self.upstream + self.path, headers=dict(self.headers))
        with urllib.request.urlopen(request, timeout=10) as reply:  # noqa: S310 - loopback
            body = bytearray(reply.read())
            headers = reply.getheaders()
            code = reply.status
        body[len(body) // 2] ^= 0xFF
        self.send_response(code)
        for name, value in headers:
            if name.lower() not in ("server", "date", "connection"):
                self.send_header(name, value)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(bytes(body))


def test_a_file_altered_on_the_way_is_not_the_agents_word(
    agents: ServedAttempt, node_side: Path, relay_side: Path
) -> None:
    result = _rescued(node_side, STATE)
    handler = type("Tamperer", (_Tamperer,), {"upstream": agents.addresses["node-a"]})
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        channel = agents.channel(Attempt(node_side))
        channel.addresses["node-a"] = "http://{}:{}".format(*proxy.server_address[:2])
        assert _fetch_state(channel, "node-a", result, relay_side, 10.0) is None
        assert not _kept(relay_side).exists()
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()

