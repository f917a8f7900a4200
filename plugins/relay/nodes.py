"""The node pool: which simulated local nodes exist and which a segment may use."""

from __future__ import annotations

import os

DEFAULT_NODES = ("node-a", "node-b", "node-c")


class NotEnoughNodesError(Exception):
    """Fewer usable nodes than the job needs."""


def inventory() -> list[str]:
    """Return the node names (``RELAY_NODES``, comma-separated; default node-a..node-c)."""
    raw = os.environ.get("RELAY_NODES")
    if not raw:
        return list(DEFAULT_NODES)
    return [n.strip() for n in raw.split(",") if n.strip()]


def select_nodes(count: int) -> list[str]:
    """Pick ``count`` nodes for a segment, in inventory order."""
    nodes = inventory()
    if len(nodes) < count:
        raise NotEnoughNodesError(
            f"node pool: expected at least {count} nodes, found {len(nodes)} ({nodes}). "
            "Add nodes to RELAY_NODES or lower `nodes` in the job spec."
        )
    return nodes[:count]
