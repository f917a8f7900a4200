"""An attempt's handle as the local and Slurm launchers keep it: ``handle.json`` beside
Relay's copy of the launch file, or the handle that travelled with the attempt (attached)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relay.core.attempt import Attempt
    from relay.launchers.agent_client import AgentChannel

HANDLE_FILE = "handle.json"


class HandleFile:
    """``handle``, ``attach`` and ``started_at`` of a launcher (a mixin: call its
    ``__init__``)."""

    def __init__(self) -> None:
        self._channels: dict[Path, AgentChannel] = {}
        self._attached: dict[Path, dict[str, Any]] = {}  # root -> a handle that travelled
        # root -> (handle.json's stat, what it said): a poll reads it twice, and at 1,024
        # nodes parsing it cost more than the detector
        self._read: dict[Path, tuple[tuple[int, int, int], dict[str, Any]]] = {}

    def handle(self, attempt: Attempt) -> dict[str, Any]:
        """Return the attempt's handle (an attached one, else ``handle.json``; {}: none)."""
        root = attempt.runs_in
        if root in self._attached:
            return dict(self._attached[root])
        try:
            seen = (root / HANDLE_FILE).stat()
            key = (seen.st_mtime_ns, seen.st_size, seen.st_ino)
            if root not in self._read or self._read[root][0] != key:
                self._read[root] = (key, dict(json.loads((root / HANDLE_FILE).read_text())))
            return dict(self._read[root][1])
        except (OSError, ValueError, TypeError):
            return {}

    def attach(self, attempt: Attempt, handle: dict[str, Any]) -> None:
        """Use ``handle`` for ``attempt`` (its ``handle.json`` may not be here)."""
        root = attempt.runs_in
        if handle:
            self._attached[root] = dict(handle)
            self._channels.pop(root, None)

    def started_at(self, attempt: Attempt) -> float:
        """Return when the attempt was launched (epoch seconds, Relay's clock)."""
        found = self.handle(attempt)
        if "started_at" not in found:
            raise KeyError(f"no launch handle for {attempt.runs_in} (neither attached nor "
                           f"{HANDLE_FILE})")
        return float(found["started_at"])
