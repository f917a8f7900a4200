"""How far this machine's clock is from a server's: MLflow's HTTP ``Date``, the Airflow DB's now().

A reading is bracketed by the local clock before and after the request, so its
uncertainty is half the round trip (plus half a second for the HTTP ``Date``
header, which has whole-second resolution).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

# now() as seconds since the epoch, per SQL dialect (SQLAlchemy's dialect names).
DB_NOW_SQL = {
    "postgresql": "SELECT EXTRACT(EPOCH FROM clock_timestamp())",
    "mysql": "SELECT UNIX_TIMESTAMP(NOW(6))",
    "sqlite": "SELECT (julianday('now') - 2440587.5) * 86400.0",
}


@dataclass(frozen=True)
class ClockReading:
    """The server's clock minus ours, in seconds, and how sure we are of it."""

    source: str
    offset_seconds: float
    uncertainty_seconds: float

    def skew_beyond(self, max_skew_seconds: float) -> bool:
        """Return whether the clocks differ by more than ``max_skew_seconds`` for sure."""
        return abs(self.offset_seconds) - self.uncertainty_seconds > max_skew_seconds

    def describe(self) -> str:
        """Return e.g. ``+0.31s (+/- 0.52s)``."""
        return f"{self.offset_seconds:+.2f}s (+/- {self.uncertainty_seconds:.2f}s)"


def http_clock(url: str, timeout_seconds: float = 5.0) -> ClockReading:
    """Read a web server's clock from the ``Date`` header of one request; raise OSError if none."""
    before = time.time()
    try:
        with urllib.request.urlopen(url, timeout=timeout_seconds) as response:  # noqa: S310
            date = response.headers.get("Date")
    except urllib.error.HTTPError as err:  # an error page still carries the server's Date
        date = err.headers.get("Date")
    after = time.time()
    if not date:
        raise OSError(f"{url} answered without a Date header")
    server = parsedate_to_datetime(date).timestamp() + 0.5  # Date is truncated to the second
    return ClockReading(f"HTTP Date of {url}", server - (before + after) / 2,
                        (after - before) / 2 + 0.5)


def db_clock(sqlalchemy_url: str, timeout_seconds: float = 5.0) -> ClockReading:
    """Read a database server's clock with one query; raise ValueError for unknown dialects."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    url = make_url(sqlalchemy_url)
    query = DB_NOW_SQL.get(url.get_backend_name())
    if query is None:
        raise ValueError(f"no clock query for {url.get_backend_name()} databases")
    args = {"connect_timeout": int(timeout_seconds)} if url.get_backend_name() != "sqlite" else {}
    engine = create_engine(url, connect_args=args)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))  # connect first: the round trip measures the query
            before = time.time()
            server = float(conn.execute(text(query)).scalar_one())
            after = time.time()
    finally:
        engine.dispose()
    return ClockReading(f"now() of the {url.get_backend_name()} database at "
                        f"{url.render_as_string(hide_password=True)}",
                        server - (before + after) / 2, (after - before) / 2)
