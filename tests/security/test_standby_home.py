"""A standby is forked only into a folder under the agent's DAG run folder, for a bounded time.

The request is signed with the attempt's secret (the credential is not what is tested
here): even Relay's own request is refused (400, no fork) when it names a folder outside
the DAG run's, or climbs out of it, or asks for an unbounded ttl or linger.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from channel_harness import ATTEMPT_ID, Served, attempt_body, serve, signed

from relay_train.agent.limits import standby_home
from relay_train.protocol.routes import (
    DIRECTORY,
    LINGER,
    MAX_LINGER_SECONDS,
    MAX_STANDBY_TTL_SECONDS,
    TTL,
    Route,
    route_path,
)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    found = serve(tmp_path / ATTEMPT_ID)
    yield found
    found.server.close()


def _ask(served: Served, directory: str, ttl: object = 60.0, linger: object = 0.0) -> int:
    body = attempt_body(**{DIRECTORY: directory, TTL: ttl, LINGER: linger})
    return signed(served.port, served.secret, "POST", route_path(Route.STANDBY), body).code


def test_a_folder_under_the_dag_run_is_accepted(served: Served) -> None:
    run = served.agent.root.parents[1]
    for folder in (run / "segment-003" / "standby", run / "segment-004" / "standby"):
        assert _ask(served, str(folder)) == 200
    assert [d for d, _ttl, _linger in served.agent.standbys] == [
        run / "segment-003" / "standby", run / "segment-004" / "standby"]


def test_a_folder_outside_it_is_refused(served: Served, tmp_path: Path) -> None:
    run = served.agent.root.parents[1]
    (tmp_path / "elsewhere").mkdir()
    (run / "segment-003" / "sneaky").symlink_to(tmp_path / "elsewhere")
    for folder in ["/tmp", str(tmp_path / "elsewhere"), str(run.parent / "run-8" / "standby"),
                   str(run / ".." / "run-8"), str(run), "relative/standby",
                   str(run / "segment-003" / "sneaky"), str(run) + "\0/x", ""]:
        assert _ask(served, folder) == 400, folder
    assert served.agent.standbys == []


@pytest.mark.parametrize(("ttl", "linger"), [
    (MAX_STANDBY_TTL_SECONDS * 2, 0.0), (0, 0.0), (-5, 0.0), ("nan", 0.0), ("inf", 0.0),
    (1e308 * 10, 0.0), (True, 0.0), ([60], 0.0), (60.0, MAX_LINGER_SECONDS + 1), (60.0, -1),
])
def test_an_unbounded_ttl_or_linger_is_refused(served: Served, ttl: object, linger: object) -> None:
    standby = served.agent.root.parent / "standby"
    assert _ask(served, str(standby), ttl, linger) == 400
    assert served.agent.standbys == []


def test_the_home_is_the_dag_run_else_the_tries_folder_else_the_attempt(tmp_path: Path) -> None:
    run = tmp_path / "relay_demo" / "manual__1"
    assert standby_home(run / "segment-000" / "try-1") == run.resolve()
    assert standby_home(tmp_path / "segment" / "try-1") == (tmp_path / "segment").resolve()
    assert standby_home(tmp_path / "attempt") == (tmp_path / "attempt").resolve()
