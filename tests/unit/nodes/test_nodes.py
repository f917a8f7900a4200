"""Unit tests for the node pool: quarantine with expiry, selection, persistence, locking, CLI.

Every behaviour test runs twice: on the default store (``$RELAY_HOME/nodes.json``) and on
the SQL store (``RELAY_NODE_POOL_URL``) over a real SQLite file. The PostgreSQL store, with
two workers that share no disk, is tested in ``tests/services/test_node_pool_postgres.py``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sqlite3
import time
from pathlib import Path

import pytest

from relay.core.exceptions import NotEnoughNodesError
from relay.nodes.pool import DEFAULT_NODES, NodePool, inventory
from relay.nodes.store import POOL_NAME, TABLE_NAME, FileStore, PoolStore, SqlStore
from relay.tools.cli import main

NODES = ["n1", "n2", "n3"]
BACKENDS = ["file", "sqlite"]


class Backend:
    """One store for a test: make pools on it, read what it holds, spoil it."""

    def __init__(self, kind: str, root: Path) -> None:
        self.kind = kind
        self.file = root / "state" / "nodes.json"
        self.db = root / "shared" / "pool.db"
        self.url = f"sqlite:///{self.db}"

    def store(self) -> PoolStore:
        if self.kind == "file":
            return FileStore(self.file)
        self.db.parent.mkdir(parents=True, exist_ok=True)
        return SqlStore(self.url)

    def pool(self, nodes: list[str] | None = None) -> NodePool:
        return NodePool(nodes=list(nodes or NODES), store=self.store())

    def raw(self) -> str | None:
        """Return the stored text of the state, or None if nothing was stored."""
        if self.kind == "file":
            return self.file.read_text() if self.file.exists() else None
        if not self.db.exists():
            return None
        with sqlite3.connect(self.db) as conn:
            try:
                row = conn.execute(f"SELECT state FROM {TABLE_NAME} WHERE pool = ?",
                                   (POOL_NAME,)).fetchone()
            except sqlite3.OperationalError:  # no table yet
                return None
        return None if row is None else row[0]

    def stored(self) -> dict | None:
        raw = self.raw()
        return None if raw is None else json.loads(raw)

    def spoil(self, content: str) -> None:
        """Replace the stored state with ``content``, as a person with an editor might."""
        if self.kind == "file":
            self.file.parent.mkdir(parents=True, exist_ok=True)
            self.file.write_text(content)
            return
        self.pool().healthy()  # creates the table and the row
        with sqlite3.connect(self.db) as conn:
            conn.execute(f"UPDATE {TABLE_NAME} SET state = ? WHERE pool = ?", (content, POOL_NAME))

    @property
    def fix(self) -> str:
        return "Fix or delete the file" if self.kind == "file" else "Fix or delete that row"

    @property
    def where(self) -> str:
        return str(self.file) if self.kind == "file" else f"{TABLE_NAME} (pool 'default') of"


EMPTY = {"quarantines": {}, "leases": {}}


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return Backend(request.param, tmp_path)


@pytest.fixture
def pool(backend: Backend) -> NodePool:
    return backend.pool()


# -- quarantine, release, healthy, select -----------------------------------------------------


def test_fresh_pool_is_all_healthy_and_writes_nothing(pool: NodePool, backend: Backend) -> None:
    assert pool.healthy() == NODES
    assert pool.quarantines() == {}
    assert pool.select(3) == NODES
    assert pool.select(2) == ["n1", "n2"]
    # Reading stores nothing (the SQL store creates its table and an empty row once).
    assert backend.stored() in ((None,) if backend.kind == "file" else ({"quarantines": {}},))


def test_quarantine_keeps_a_node_out_until_released(pool: NodePool) -> None:
    before = time.time()
    q = pool.quarantine("n2", 1800, reason="hang: rank 3 stalled", by="rules.hang")
    assert q.node == "n2" and q.reason == "hang: rank 3 stalled" and q.by == "rules.hang"
    assert before <= q.since <= time.time()
    assert q.until == pytest.approx(q.since + 1800)

    assert set(pool.quarantines()) == {"n2"}
    assert pool.quarantines()["n2"] == q
    assert pool.healthy() == ["n1", "n3"]
    assert pool.select(2) == ["n1", "n3"]

    assert pool.release("n2") is True
    assert pool.healthy() == NODES
    assert pool.release("n2") is False  # nothing left to release


def test_a_longer_quarantine_is_not_shortened(pool: NodePool) -> None:
    first = pool.quarantine("n1", 3600, reason="node_unresponsive", by="rules.node_unresponsive")
    second = pool.quarantine("n1", 60, reason="straggler", by="rules.straggler")
    assert second == first  # the existing, longer quarantine stays, with its reason
    assert pool.quarantines()["n1"] == first

    third = pool.quarantine("n1", 7200, reason="crash", by="rules.crash")
    assert third.until > first.until  # ...but a longer one extends it
    assert pool.quarantines()["n1"].reason == "crash"


def test_quarantine_expires(pool: NodePool) -> None:
    q = pool.quarantine("n3", 0.2, reason="brief", by="test")
    assert pool.healthy(now=q.since) == ["n1", "n2"]  # not pool.healthy(): a slow fsync
    assert pool.healthy(now=q.until + 0.01) == NODES  # judged at a later time
    time.sleep(max(0.0, q.until - time.time()) + 0.05)
    assert pool.healthy() == NODES
    assert pool.quarantines() == {}
    assert pool.select(3) == NODES


def test_select_too_many_names_the_quarantined_nodes_and_the_fix(pool: NodePool) -> None:
    pool.quarantine("n2", 600, reason="hang: rank 3 stalled", by="rules.hang")
    pool.quarantine("n3", 600, reason="crash: rank 5 exited", by="rules.crash")
    with pytest.raises(NotEnoughNodesError) as info:
        pool.select(2)
    text = str(info.value)
    assert "expected 2 healthy nodes, found 1 (n1)" in text
    for expected in ("n2", "hang: rank 3 stalled", "n3", "crash: rank 5 exited",
                     "relay nodes release", "RELAY_NODES"):
        assert expected in text, f"{expected!r} not in {text!r}"


def test_select_more_than_the_inventory_fails_even_with_no_quarantine(pool: NodePool) -> None:
    with pytest.raises(NotEnoughNodesError, match="expected 4 healthy nodes, found 3"):
        pool.select(4)


def test_select_waits_for_a_quarantine_to_expire(pool: NodePool) -> None:
    q = pool.quarantine("n2", 0.5, reason="brief", by="test")
    start = time.monotonic()
    assert pool.select(3, wait_up_to=5, poll_seconds=0.05) == NODES
    assert time.time() >= q.until, "selected n2 while it was still quarantined"
    assert time.monotonic() - start < 4.5


def test_select_gives_up_after_wait_up_to(pool: NodePool) -> None:
    pool.quarantine("n2", 600, reason="long", by="test")
    start = time.monotonic()
    with pytest.raises(NotEnoughNodesError, match="long"):
        pool.select(3, wait_up_to=0.3, poll_seconds=0.05)
    assert 0.25 < time.monotonic() - start < 3.0


def test_state_survives_a_restart(pool: NodePool, backend: Backend) -> None:
    q = pool.quarantine("n1", 600, reason="crash", by="rules.crash")
    again = backend.pool()
    assert again.quarantines() == {"n1": q}
    assert again.healthy() == ["n2", "n3"]
    assert backend.stored()["quarantines"]["n1"]["reason"] == "crash"


def test_unknown_node_is_rejected(pool: NodePool, backend: Backend) -> None:
    with pytest.raises(ValueError, match=r"node 'n9': expected one of \['n1', 'n2', 'n3'\]"):
        pool.quarantine("n9", 60, reason="x", by="test")
    assert backend.stored() is None


@pytest.mark.parametrize("content", ["{not json", "", "\x00\x01garbage"])
def test_corrupt_state_is_reported_and_kept(
    pool: NodePool, backend: Backend, content: str
) -> None:
    backend.spoil(content)
    for call in (lambda: pool.quarantine("n1", 60, reason="x", by="test"),
                 lambda: pool.release("n1"), pool.healthy, lambda: pool.select(1)):
        with pytest.raises(RuntimeError) as info:
            call()
        text = str(info.value)
        assert backend.where in text
        assert backend.fix in text
    assert backend.raw() == content  # never overwritten


@pytest.mark.parametrize("content", ["{}", "[]"])
def test_state_of_the_wrong_shape_is_reported(
    pool: NodePool, backend: Backend, content: str
) -> None:
    backend.spoil(content)
    with pytest.raises(RuntimeError, match=backend.fix):
        pool.healthy()


def _quarantine_in_child(backend: Backend, nodes: list[str], node: str,
                         barrier: multiprocessing.synchronize.Barrier) -> None:
    pool = backend.pool(nodes)
    barrier.wait(timeout=20)
    for i in range(10):  # each write replaces the whole state: a lost update would show
        pool.quarantine(node, 3600 + i, reason=f"by {node}", by="test")


def _lease_in_child(backend: Backend, nodes: list[str], worker: int,
                    barrier: multiprocessing.synchronize.Barrier) -> None:
    pool = backend.pool(nodes)
    barrier.wait(timeout=20)
    for i in range(4):  # a new DAG run each time: its lease must never take another's node
        pool.select(1, holder=f"w{worker}/run-{i}")


def _run_children(target: object, backend: Backend, nodes: list[str], count: int) -> None:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(count)
    procs = [ctx.Process(target=target, args=(backend, nodes, arg, barrier))
             for arg in (nodes if target is _quarantine_in_child else range(count))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * count


def test_concurrent_quarantines_lose_no_update(backend: Backend) -> None:
    nodes = [f"n{i}" for i in range(8)]
    _run_children(_quarantine_in_child, backend, nodes, len(nodes))

    held = backend.pool(nodes).quarantines()
    assert set(held) == set(nodes)
    for node, q in held.items():
        assert q.reason == f"by {node}"
        assert q.until == pytest.approx(q.since + 3609)


def test_concurrent_leases_never_share_a_node(backend: Backend) -> None:
    nodes = [f"n{i:02}" for i in range(26)]
    backend.pool(nodes).quarantine("n00", 600, reason="bad NIC", by="test")
    _run_children(_lease_in_child, backend, nodes, 6)

    leases = backend.pool(nodes).leases()
    holders = sorted(lease["holder"] for lease in leases.values())
    # 24 leases, one per DAG run: a lost update would drop one, a shared node would merge two.
    assert holders == sorted(f"w{w}/run-{i}" for w in range(6) for i in range(4))
    assert "n00" not in leases  # the quarantine is honoured by every process


# -- inventory ---------------------------------------------------------------------------------


def test_inventory_reads_relay_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_NODES", " a, b ,,c ")
    assert inventory() == ["a", "b", "c"]
    monkeypatch.delenv("RELAY_NODES")
    assert inventory() == list(DEFAULT_NODES)


# -- `relay nodes ...` -------------------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def cli_home(request: pytest.FixtureRequest, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RELAY_HOME", str(tmp_path))
    monkeypatch.setenv("RELAY_NODES", "n1,n2,n3")
    if request.param == "sqlite":
        monkeypatch.setenv("RELAY_NODE_POOL_URL", f"sqlite:///{tmp_path / 'pool.db'}")
    else:
        monkeypatch.delenv("RELAY_NODE_POOL_URL", raising=False)
    return tmp_path


def test_cli_nodes_list_quarantine_release(
    cli_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["nodes", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == NODES
    assert all(line.split()[1] == "healthy" for line in out)

    assert main(["nodes", "quarantine", "n2", "--for", "30m", "--reason", "flaky NIC"]) == 0
    assert capsys.readouterr().out.startswith("n2 quarantined until ")
    held = NodePool(nodes=list(NODES)).quarantines()
    assert set(held) == {"n2"}
    assert held["n2"].until - held["n2"].since == pytest.approx(1800)
    assert held["n2"].reason == "flaky NIC"
    # The state is where the settings say: nodes.json only without RELAY_NODE_POOL_URL.
    assert (cli_home / "nodes.json").exists() is (os.environ.get("RELAY_NODE_POOL_URL") is None)

    assert main(["nodes", "list"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "quarantined until" in lines["n2"]
    assert "flaky NIC" in lines["n2"] and "(by relay nodes quarantine (by hand))" in lines["n2"]
    assert lines["n1"].split()[1] == "healthy" and lines["n3"].split()[1] == "healthy"

    assert main(["nodes", "release", "n2"]) == 0
    assert capsys.readouterr().out.strip() == "n2 released"
    assert main(["nodes", "release", "n2"]) == 0
    assert capsys.readouterr().out.strip() == "n2 was not quarantined"
    assert NodePool(nodes=list(NODES)).healthy() == NODES


def test_cli_nodes_quarantine_defaults_to_one_hour(cli_home: Path) -> None:
    assert main(["nodes", "quarantine", "n1"]) == 0
    q = NodePool(nodes=list(NODES)).quarantines()["n1"]
    assert q.until - q.since == pytest.approx(3600)
    assert q.reason == "quarantined by hand"


@pytest.mark.parametrize("argv", [["quarantine", "n9"], ["release", "n9"]])
def test_cli_nodes_unknown_node(
    cli_home: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert main(["nodes", *argv]) == 2
    err = capsys.readouterr().err
    assert "node 'n9': expected one of ['n1', 'n2', 'n3']" in err
    assert not (cli_home / "nodes.json").exists()


def test_cli_nodes_bad_duration(cli_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nodes", "quarantine", "n1", "--for", "soon"]) == 2
    err = capsys.readouterr().err
    assert "relay nodes quarantine --for" in err and "'soon'" in err
    assert not (cli_home / "nodes.json").exists()


# -- leases: two DAG runs never train on one node at once ----------------------------------


def test_a_leased_node_is_not_given_to_another_dag_run(pool: NodePool) -> None:
    first = pool.select(1, holder="relay_a/run-1")
    assert first == list(NODES[:1])
    second = pool.select(1, holder="relay_b/run-1")
    assert not set(first) & set(second)
    with pytest.raises(NotEnoughNodesError, match="in use by other DAG runs: .*relay_a/run-1"):
        pool.select(2, holder="relay_c/run-1")
    assert pool.available("relay_c/run-1") == [n for n in NODES if n not in first + second]


def test_the_same_holder_releases_and_re_leases(pool: NodePool) -> None:
    pool.select(3, holder="relay_a/run-1")
    retry = pool.select(2, holder="relay_a/run-1")  # its next attempt: earlier leases replaced
    assert set(pool.leases()) == set(retry)
    assert pool.release_lease("relay_a/run-1") == retry
    assert pool.leases() == {}
    assert pool.select(len(NODES), holder="relay_b/run-1") == list(NODES)


def test_an_expired_lease_frees_its_nodes(pool: NodePool) -> None:
    pool.select(len(NODES), holder="relay_a/killed", lease_seconds=0.05)
    time.sleep(0.1)
    assert pool.select(2, holder="relay_b/run-1") == list(NODES[:2])


def test_quarantined_nodes_are_never_leased(pool: NodePool) -> None:
    pool.quarantine(NODES[0], 60, "test", by="test")
    assert NODES[0] not in pool.select(2, holder="relay_a/run-1")


def test_next_lease_is_what_select_then_picks(pool: NodePool) -> None:
    pool.select(1, holder="relay_a/run-1")
    assert pool.next_lease("relay_b/run-1", 1, leave_out={NODES[1]}) == [NODES[2]]
    assert pool.next_lease("relay_b/run-1", len(NODES)) is None  # one is leased to relay_a
    assert pool.select(2, holder="relay_b/run-1") == pool.next_lease("relay_b/run-1", 2)


def test_select_leaves_a_preempted_node_out_of_one_lease_only(pool: NodePool) -> None:
    first = pool.select(2, holder="run-1")
    assert first == ["n1", "n2"]
    again = pool.select(2, holder="run-1", leave_out=frozenset({"n1"}))
    assert again == ["n2", "n3"]  # n1 is healthy, not quarantined: only left out this time
    assert "n1" not in pool.leases() and pool.quarantines() == {}
    assert pool.select(2, holder="run-1") == ["n1", "n2"]
    assert pool.select(2, leave_out=frozenset({"n2"})) == ["n1", "n3"]  # no holder: the same
