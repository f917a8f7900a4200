"""Which nodes count as gone quiet, and what the watcher is told to warm (relay.spare)."""

from __future__ import annotations

from pathlib import Path

from relay import spare
from relay.launchers.base import LaunchState, LaunchStatus, NodeStatus


def _status(**last_seen: float | None) -> LaunchStatus:
    nodes = {n: NodeStatus(n, "running", last_seen=t) for n, t in last_seen.items()}
    return LaunchStatus(LaunchState.RUNNING, nodes)


def test_only_an_agent_heard_before_and_quiet_since_is_silent() -> None:
    status = _status(**{"node-a": 99.5, "node-b": 98.0, "node-c": None})
    # node-c never answered: an agent still starting up, not a node that stopped
    assert spare.silent_nodes(status, after=1.0) == ["node-b"]
    assert spare.silent_nodes(status, after=2.5) == []
    assert spare.silent_nodes(None, after=1.0) == []


def test_a_poll_that_waited_for_a_silent_agent_does_not_make_the_others_silent() -> None:
    # every node answered in the same poll, which then waited 1 s for a slow one: what
    # counts is the gap to the freshest answer, not the age at the end of the poll
    assert spare.silent_nodes(_status(**{"node-a": 99.0, "node-b": 99.1}), after=1.0) == []
    assert spare.silent_nodes(_status(**{"node-a": 98.0}), after=1.0) == []  # alone: no peer


def test_the_plan_names_the_first_free_node_or_nothing(tmp_path: Path) -> None:
    assert spare.plan(tmp_path, ["node-c", "node-d"], 60.0) == {
        "directory": str(tmp_path), "node": "node-c", "ttl": 60.0}
    assert spare.plan(tmp_path, [], 60.0) is None
    assert spare.suspect_after(0.5) == 0.5
