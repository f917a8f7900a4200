"""RELAY_NODE_POOL_URL: which store the node pool uses, and the errors when it cannot work.

Real: SQLite files, and psycopg connecting to a loopback port where nothing listens (the
"database is down" case). A PostgreSQL that answers is in
``tests/services/test_node_pool_postgres.py`` (`make test-postgres`).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from relay.core.exceptions import PoolStoreError
from relay.core.faults import Fault, FaultKind
from relay.core.settings import REPO_ROOT
from relay.nodes.pool import NodePool
from relay.nodes.store import FileStore, SqlStore, from_settings
from relay.policy.decide import decide
from relay.policy.model import load_policy
from relay.recover.pipeline import quarantine
from relay.tools import doctor
from relay.tools.cli import main
from relay.tools.doctor import Status


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RELAY_NODES", "node-a,node-b,node-c")
    monkeypatch.delenv("RELAY_NODE_POOL_URL", raising=False)
    return tmp_path / "home"


def closed_port() -> int:
    """Return a loopback port where nothing listens (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def down_url(home: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"postgresql://relay:s3cret@127.0.0.1:{closed_port()}/relay"
    monkeypatch.setenv("RELAY_NODE_POOL_URL", url)
    return url


def test_unset_means_the_local_file(home: Path) -> None:
    store = from_settings()
    assert isinstance(store, FileStore) and store.path == home.resolve() / "nodes.json"


def test_set_means_the_database(home: Path, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_NODE_POOL_URL", f"sqlite:///{tmp_path / 'pool.db'}")
    assert isinstance(from_settings(), SqlStore)
    NodePool().quarantine("node-b", 60, reason="ECC", by="test")
    assert NodePool().healthy() == ["node-a", "node-c"]
    assert not (home / "nodes.json").exists()


@pytest.mark.parametrize(("url", "expected", "found", "fix"), [
    ("not a url", "a SQLAlchemy database URL such as postgresql://", "'not a url'",
     "Fix the variable"),
    ("mysql://relay@db/relay", "a postgresql:// or sqlite:/// URL", "'mysql'",
     "Point it at PostgreSQL"),
    ("sqlite:///relative.db", "an absolute file path", "sqlite:///relative.db",
     "absolute path on a shared file system"),
    ("sqlite://", "an absolute file path", "sqlite://", "absolute path"),
    ("postgresql+pg8000://relay@db/relay", "a URL whose database driver is installed",
     "no driver for postgresql+pg8000", "psycopg[binary]==3.3.9"),
])
def test_a_bad_url_names_the_setting_what_was_expected_found_and_the_fix(
    home: Path, monkeypatch: pytest.MonkeyPatch, url: str, expected: str, found: str, fix: str
) -> None:
    monkeypatch.setenv("RELAY_NODE_POOL_URL", url)
    with pytest.raises(PoolStoreError) as info:
        NodePool().select(1, holder="relay_demo/run-1")
    text = str(info.value)
    for part in ("RELAY_NODE_POOL_URL", expected, found, fix, "unset RELAY_NODE_POOL_URL"):
        assert part in text, f"{part!r} not in {text!r}"
    assert not (home / "nodes.json").exists()  # no fallback to this machine's file


def test_a_database_that_is_down_fails_the_decision_and_never_falls_back(
    home: Path, down_url: str
) -> None:
    """What execute (select) and execute_complete (quarantine) meet when the database is down."""
    with pytest.raises(PoolStoreError) as info:
        NodePool().select(2, holder="relay_demo/run-1")
    text = str(info.value)
    assert text.startswith("RELAY_NODE_POOL_URL=postgresql://relay:***@127.0.0.1:")
    assert "s3cret" not in text
    assert "OperationalError" in text and "Start the database or fix the URL" in text
    assert "does not fall back to this machine's nodes.json" in text

    policy = load_policy(REPO_ROOT / "policies" / "default.yaml")
    fault = Fault(FaultKind.NODE_UNRESPONSIVE, None, "node-b", {"summary": "frozen"})
    decision = decide(fault, [], policy.policy, policy.sha256)
    assert decision.quarantine_node == "node-b"
    with pytest.raises(PoolStoreError, match="RELAY_NODE_POOL_URL"):
        quarantine(decision, fault, "relay_demo/run-1")
    assert not (home / "nodes.json").exists()


def test_cli_reports_a_database_that_is_down(
    home: Path, down_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["nodes", "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("RELAY_NODE_POOL_URL=postgresql://relay:***@")
    assert "Start the database" in err


def test_doctor_checks_the_node_pool(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = doctor.check_node_pool()
    assert local.status is Status.OK and "local file" in local.detail
    assert "RELAY_NODE_POOL_URL" in local.detail

    monkeypatch.setenv("RELAY_NODE_POOL_URL", f"sqlite:///{tmp_path / 'pool.db'}")
    NodePool().quarantine("node-a", 60, reason="ECC", by="test")
    shared = doctor.check_node_pool()
    assert shared.status is Status.OK
    assert shared.detail.endswith("pool.db: 1 quarantine(s), 0 lease(s)")

    monkeypatch.setenv("RELAY_NODE_POOL_URL",
                       f"postgresql://relay:s3cret@127.0.0.1:{closed_port()}/relay")
    down = doctor.check_node_pool()
    assert down.status is Status.FAIL
    assert "RELAY_NODE_POOL_URL" in down.detail and "Start the database" in down.detail
    assert "s3cret" not in doctor.render([down])
