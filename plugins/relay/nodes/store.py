"""Where the node pool keeps its state: a local file, or a SQL database every worker shares.

:class:`FileStore` (the zero-setup default) is ``$RELAY_HOME/nodes.json`` under an
exclusive ``flock``, replaced atomically: right when every process that decides
runs on one machine (``airflow dags test``, ``make up``, the LocalExecutor).

:class:`SqlStore` is chosen by ``RELAY_NODE_POOL_URL`` (a SQLAlchemy URL,
``postgresql://...`` or ``sqlite:////shared/path.db``). With the Celery or
Kubernetes executor ``execute``, the trigger and ``execute_complete`` may run on
different machines, and a quarantine or lease must be seen by all of them. The
state is **one row per pool** in table ``relay_node_pool`` holding the same
JSON document as ``nodes.json``, not a row per node, because every decision
reads the whole pool: a lease picks among all healthy, unleased nodes, so it
needs the pool locked as a whole, and locking one row is exactly that
(``SELECT ... FOR UPDATE`` on PostgreSQL; ``BEGIN IMMEDIATE`` on SQLite, which
serialises writers). Rows per node would need every node row (or the table)
locked for the same decision, and a node added to ``RELAY_NODES`` would be a
row no lock covers. Decisions are a few per minute, so one row is no
bottleneck, and the document is the file's, so ``relay nodes`` and the tests
see one behaviour. This is Relay's own database: never Airflow's metadata
database through Airflow's models (Airflow 3 forbids that from task code),
though it may be another database on the same PostgreSQL server.

A store that cannot be reached raises :class:`PoolStoreError` naming the setting
and the fix; nothing falls back to the local file, which would split the pool.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

from relay.core import settings
from relay.core.exceptions import PoolStoreError
from relay_train.protocol.heartbeat import write_atomically

TABLE_NAME = "relay_node_pool"
POOL_NAME = "default"
LOCK_TIMEOUT = "30s"  # a worker frozen inside the transaction must not block the rest forever
CONNECT_TIMEOUT_SECONDS = 10
_ADVISORY_KEY = 0x52454C4159504F4F  # "RELAYPOO": serialises creating the table on PostgreSQL
BACKENDS = ("postgresql", "sqlite")
EXAMPLES = "postgresql://USER:PASSWORD@HOST:5432/relay or sqlite:////shared/relay/nodes.db"


class PoolStore(Protocol):
    """What the node pool needs from where its state lives."""

    def locked(self) -> AbstractContextManager[dict[str, Any]]:
        """Yield the state, locked against every other decider; write it back if changed."""

    def describe(self) -> str:
        """Say where the state lives (no password)."""


def _parse(raw: str, where: str, fix: str) -> dict[str, Any]:
    """Return the pool's state from its JSON text; raise PoolStoreError if it is not one."""
    try:
        state = json.loads(raw)
    except ValueError as exc:
        raise PoolStoreError(f"{where}: expected the node pool's JSON state, found unreadable "
                             f"content ({exc}). {fix}; only quarantines are lost.") from exc
    if not isinstance(state, dict) or not isinstance(state.get("quarantines"), dict):
        raise PoolStoreError(f"{where}: expected a JSON object with a `quarantines` mapping, "
                             f"found {type(state).__name__} without one. {fix}; only "
                             "quarantines are lost.")
    if not isinstance(state.get("leases"), dict):
        state["leases"] = {}
    return state


def _dump(state: dict[str, Any]) -> str:
    return json.dumps(state, indent=2, sort_keys=True)


class FileStore:
    """The pool's state in one JSON file on this machine, under ``flock``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def describe(self) -> str:
        """Say where the state lives."""
        return f"local file {self.path}"

    @contextmanager
    def locked(self) -> Iterator[dict[str, Any]]:
        """Yield the state under an exclusive lock; replace the file atomically if changed."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                raw = self.path.read_text()
            except FileNotFoundError:
                raw = '{"quarantines": {}}'
            state = _parse(raw, str(self.path), "Fix or delete the file")
            before = _dump(state)
            yield state
            if _dump(state) != before:
                write_atomically(self.path, _dump(state), durable=True)


def _setting_error(found: str, expected: str, fix: str) -> PoolStoreError:
    return PoolStoreError(
        f"{settings.NODE_POOL_URL_ENV}: expected {expected}, found {found}. {fix}; or unset "
        f"{settings.NODE_POOL_URL_ENV} to keep the pool in $RELAY_HOME/nodes.json (one "
        "machine only).")


def parse_url(raw: str) -> Any:  # noqa: ANN401 - sqlalchemy.engine.URL, imported lazily
    """Return the URL of ``RELAY_NODE_POOL_URL``; raise PoolStoreError if it cannot work."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(raw)
    except ArgumentError:
        raise _setting_error(repr(raw), f"a SQLAlchemy database URL such as {EXAMPLES}",
                             "Fix the variable") from None
    shown = url.render_as_string(hide_password=True)
    if url.get_backend_name() not in BACKENDS:
        raise _setting_error(f"{url.get_backend_name()!r} in {shown}",
                             "a postgresql:// or sqlite:/// URL (the two databases whose "
                             "locking Relay's node pool is tested on)", "Point it at PostgreSQL")
    if url.get_backend_name() == "sqlite" and not (url.database and
                                                   os.path.isabs(url.database)):
        raise _setting_error(shown, "an absolute file path (sqlite:////shared/relay/nodes.db): "
                             "a relative or in-memory database is a different one in each "
                             "process", "Give the file's absolute path on a shared file system")
    return url


@functools.lru_cache(maxsize=8)
def _engine(raw: str) -> Any:  # noqa: ANN401 - sqlalchemy.engine.Engine, imported lazily
    """Return an engine for ``raw`` that opens a connection per decision (fork-safe)."""
    from sqlalchemy import create_engine, event
    from sqlalchemy.exc import NoSuchModuleError
    from sqlalchemy.pool import NullPool

    url = parse_url(raw)
    sqlite = url.get_backend_name() == "sqlite"
    args: dict[str, Any] = ({"timeout": CONNECT_TIMEOUT_SECONDS * 3} if sqlite else
                            {"connect_timeout": CONNECT_TIMEOUT_SECONDS,
                             "application_name": "relay-node-pool"})
    try:
        engine = create_engine(url, poolclass=NullPool, connect_args=args)
    except (NoSuchModuleError, ImportError) as exc:
        raise _setting_error(
            f"no driver for {url.drivername} ({exc})", "a URL whose database driver is installed",
            "Install it: postgresql:// uses psycopg 3 (pip install 'psycopg[binary]==3.3.9', "
            "pinned in requirements.lock), postgresql+psycopg2:// uses psycopg2-binary==2.9.13"
            ) from None
    if sqlite:  # SQLAlchemy's recipe: take BEGIN from pysqlite, and make it IMMEDIATE
        event.listen(engine, "connect",
                     lambda dbapi, _record: setattr(dbapi, "isolation_level", None))
        event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    return engine


def _table() -> Any:  # noqa: ANN401 - sqlalchemy.Table
    from sqlalchemy import Column, Float, MetaData, String, Table, Text

    return Table(TABLE_NAME, MetaData(), Column("pool", String(200), primary_key=True),
                 Column("state", Text, nullable=False), Column("updated_at", Float))


class SqlStore:
    """The pool's state in one row of a database every worker reaches (module docstring)."""

    _ready: set[str] = set()  # URLs whose table this process has made sure of

    def __init__(self, url: str, pool: str = POOL_NAME) -> None:
        self.raw_url = url
        self.pool = pool
        self.url = parse_url(url)
        self.table = _table()

    def describe(self) -> str:
        """Say where the state lives (password hidden)."""
        return (f"table {TABLE_NAME} (pool {self.pool!r}) of "
                f"{self.url.render_as_string(hide_password=True)}")

    def _fail(self, exc: Exception) -> PoolStoreError:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        return PoolStoreError(
            f"{settings.NODE_POOL_URL_ENV}={self.url.render_as_string(hide_password=True)}: "
            f"expected a reachable database holding the node pool (table {TABLE_NAME}), found: "
            f"{type(exc).__name__}: {detail[0] if detail else '?'}. Start the database or fix "
            "the URL (and check this user may create and update that table). Relay does not "
            "fall back to this machine's nodes.json: other workers could not see its "
            "quarantines and leases.")

    def _create(self, conn: Any) -> None:  # noqa: ANN401 - sqlalchemy.Connection
        from sqlalchemy import text

        if self.url.get_backend_name() == "postgresql":  # two first workers at once
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _ADVISORY_KEY})
        self.table.create(conn, checkfirst=True)

    def _row(self, conn: Any) -> str:  # noqa: ANN401 - sqlalchemy.Connection
        """Return the pool's row locked for update, inserting an empty one first if missing."""
        from sqlalchemy import select
        from sqlalchemy.dialects import postgresql, sqlite

        query = select(self.table.c.state).where(self.table.c.pool == self.pool)
        raw = conn.execute(query.with_for_update()).scalar_one_or_none()
        if raw is None:
            pg = self.url.get_backend_name() == "postgresql"
            insert = postgresql.insert if pg else sqlite.insert
            conn.execute(insert(self.table).values(
                pool=self.pool, state='{"quarantines": {}}').on_conflict_do_nothing())
            raw = conn.execute(query.with_for_update()).scalar_one()
        return raw

    @contextmanager
    def locked(self) -> Iterator[dict[str, Any]]:
        """Yield the state inside a transaction holding the pool's row; update it if changed."""
        from sqlalchemy import text, update
        from sqlalchemy.exc import SQLAlchemyError

        engine = _engine(self.raw_url)
        try:
            with engine.begin() as conn:
                if self.url.get_backend_name() == "postgresql":
                    conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'"))
                if self.raw_url not in SqlStore._ready:
                    self._create(conn)
                raw = self._row(conn)
                state = _parse(raw, self.describe(),
                               f"Fix or delete that row (DELETE FROM {TABLE_NAME} WHERE "
                               f"pool = '{self.pool}')")
                before = _dump(state)
                yield state
                if _dump(state) != before:
                    conn.execute(update(self.table).where(self.table.c.pool == self.pool)
                                 .values(state=_dump(state), updated_at=time.time()))
        except SQLAlchemyError as exc:
            raise self._fail(exc) from exc
        SqlStore._ready.add(self.raw_url)  # only once the table's creation is committed


def from_settings() -> PoolStore:
    """Return the store ``RELAY_NODE_POOL_URL`` names, else ``$RELAY_HOME/nodes.json``."""
    url = settings.node_pool_url()
    if url is None:
        return FileStore(settings.relay_home() / "nodes.json")
    return SqlStore(url)
