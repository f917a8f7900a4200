"""What a node agent reads from its node's files to answer Relay: heartbeats with their
ages, the boundaries rank 0 crossed, its first step, the ranks' stacks answers; and the one
signal it sends a silent rank (its faulthandler's). Stdlib only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relay_train.protocol import routes as wire
from relay_train.protocol.heartbeat import read_heartbeats
from relay_train.protocol.launch import BOUNDARIES_FILE
from relay_train.protocol.pids import signal_process, start_time
from relay_train.protocol.stacks_files import REQUEST_FILE as STACKS_REQUEST
from relay_train.protocol.stacks_files import armed_path

CROSSED_REPORTED = 16  # the last boundary crossings a status answer carries (Relay keeps all)


def heartbeat_report(directory: Path, ranks: list[int], now: float) -> list[dict[str, Any]]:
    """Return the ranks' latest heartbeats, each with its ages on this node's clock."""
    beats = read_heartbeats(directory)
    report = []
    for rank in sorted(r for r in beats if r in ranks):
        beat = beats[rank]
        record = json.loads(beat.to_json())
        record[wire.AGE_SECONDS] = now - beat.wall_clock
        record[wire.PHASE_AGE_SECONDS] = now - beat.phase_started_at
        report.append(record)
    return report


def crossed_report(root: Path, ranks: list[int], last: int = CROSSED_REPORTED) -> list[int]:
    """Return the last segment boundaries rank 0 recorded crossing (only its node has any)."""
    if 0 not in ranks:
        return []
    try:
        lines = (root / BOUNDARIES_FILE).read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line being written
    return steps[-last:]


def signal_faulthandler(folder: Path, rank: int) -> bool:
    """Ask a silent rank's faulthandler for its stacks: only an armed, living process.

    The armed record names the rank's pid and its start time; a pid whose process
    started at another time is someone else's now, and SIGUSR2's default action kills.
    """
    armed = read_json(armed_path(folder, rank))
    if armed is None or armed.get("started") is None or rank_exited(folder, rank):
        return False
    try:
        return signal_process(int(armed["pid"]), int(armed["started"]), int(armed["signal"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def pending_request_id(folder: Path) -> object:
    record = read_json(folder / STACKS_REQUEST)
    return None if record is None else record.get(wire.REQUEST_ID)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def rank_exited(folder: Path, rank: int) -> bool:
    """Return whether an armed rank of this node has exited (it can answer nothing)."""
    armed = read_json(armed_path(folder, rank))
    if armed is None or armed.get("started") is None:
        return False
    return start_time(int(armed["pid"])) != armed["started"]
