"""The rescue exchange: the node-local files of a rescue and the answer Relay reads.

Relay asks a node's agent over the channel (``POST rescue``); the agent hands the
request to its ranks as a file, and the rank asked answers in files beside it
(:mod:`relay_train.rescue` is the rank's side). In ``<attempt>/rescue/``:
``request.json`` (the agent: which rank, for which fault), ``ack.json`` (the
rank: on it), ``done.json`` (the rank: a :class:`RescueResult`). The agent
reports the last two over the channel (``GET rescue``), and Relay keeps the
result it verified in the same form. Stdlib only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RESCUE_DIR = "rescue"  # in the attempt folder, on the node
REQUEST_FILE = "request.json"
ACK_FILE = "ack.json"
DONE_FILE = "done.json"


@dataclass(frozen=True)
class RescueResult:
    """What a rescued rank wrote (or why it did not)."""

    rank: int
    step: int | None = None
    path: str | None = None
    sha256: str | None = None
    size_bytes: int | None = None
    refused: str | None = None
    seconds: float = 0.0

    @classmethod
    def read(cls, path: Path) -> RescueResult:
        """Parse ``done.json``."""
        return cls(**json.loads(path.read_text()))
