"""Relay's requests a node agent hands to its ranks through node-local files, and their
answers: a rescue of a rank's state (:mod:`relay_train.protocol.rescue_files`) and the
ranks' stacks (:mod:`relay_train.protocol.stacks_files`). The channel's routes for them
are in :mod:`relay_train.agent.server`. Stdlib only.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from relay_train.agent.node_files import (
    pending_request_id,
    rank_exited,
    read_json,
    read_text,
    signal_faulthandler,
)
from relay_train.protocol import routes as wire
from relay_train.protocol.heartbeat import node_clock, write_atomically
from relay_train.protocol.rescue_files import ACK_FILE, DONE_FILE, RESCUE_DIR
from relay_train.protocol.rescue_files import REQUEST_FILE as RESCUE_REQUEST
from relay_train.protocol.stacks_files import (
    EVIDENCE_DIR,
    answer_path,
    faulthandler_path,
    fr_dump_path,
    trace_path,
)
from relay_train.protocol.stacks_files import REQUEST_FILE as STACKS_REQUEST


def ask_rescue(root: Path, ranks: list[int], node: str, body: dict[str, Any]) -> dict[str, Any]:
    """Hand Relay's rescue request to one of this node's ranks (POST /v1/rescue)."""
    rank = int(body[wire.RANK])
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not on node {node}")
    folder = root / RESCUE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(folder / RESCUE_REQUEST, json.dumps(
        {wire.RANK: rank, wire.FAULT: body.get(wire.FAULT), "at": node_clock()}))
    return {wire.RANK: rank}


def rescue_state(root: Path) -> dict[str, Any]:
    """Return whether the rank acknowledged the rescue, and its result (GET /v1/rescue)."""
    folder = root / RESCUE_DIR
    done = None
    if (folder / DONE_FILE).exists():
        done = json.loads((folder / DONE_FILE).read_text())
    return {wire.ACK: (folder / ACK_FILE).exists(), wire.DONE: done}


def rescued_file(root: Path, query: dict[str, Any]) -> bytes:
    """Return the rescued state's bytes, only from this attempt's rescue folder."""
    step = int(query[wire.STEP])
    done = json.loads((root / RESCUE_DIR / DONE_FILE).read_text())
    if done.get("step") != step or not done.get("path"):
        raise ValueError(f"no rescued state at step {step}")
    path = Path(os.path.realpath(str(done["path"])))
    if not path.is_relative_to(os.path.realpath(root / RESCUE_DIR)):
        raise ValueError(f"the rescued state {path} is not in this attempt's "
                         f"{RESCUE_DIR}/ folder")
    return path.read_bytes()


def ask_stacks(root: Path, body: dict[str, Any]) -> dict[str, Any]:
    """Ask this node's ranks for their stacks, once per request id (POST /v1/stacks)."""
    folder = root / EVIDENCE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    request_id = body[wire.REQUEST_ID]
    if not (folder / STACKS_REQUEST).exists() or pending_request_id(folder) != request_id:
        write_atomically(folder / STACKS_REQUEST, json.dumps(
            {wire.REQUEST_ID: str(request_id), wire.FAULT: body.get(wire.FAULT),
             wire.CULPRIT_RANK: body.get(wire.CULPRIT_RANK), "at": node_clock()}))
    return {wire.REQUEST_ID: request_id}


def stacks_answers(root: Path, ranks: list[int], query: dict[str, Any]) -> dict[str, Any]:
    """Return the ranks' answers to a stacks request, or their faulthandler's output and
    which ranks exited (GET /v1/stacks)."""
    folder = root / EVIDENCE_DIR
    answers, traces, pickles, fallback, exited = {}, {}, {}, {}, []
    for rank in ranks:
        record = read_json(answer_path(folder, rank))
        if record is not None and record.get("request") == query[wire.REQUEST_ID]:
            answers[str(rank)] = record
            trace = read_json(trace_path(folder, rank))
            if trace is not None:
                traces[str(rank)] = trace
            pickled = fr_dump_path(folder, rank)
            if pickled.exists():
                pickles[str(rank)] = base64.b64encode(pickled.read_bytes()).decode()
            continue
        text = read_text(faulthandler_path(folder, rank))
        if text.strip():
            fallback[str(rank)] = text
        if rank_exited(folder, rank):
            exited.append(rank)
    return {wire.ANSWERS: answers, wire.TRACES: traces, wire.FR_PICKLES: pickles,
            wire.FAULTHANDLER: fallback, wire.EXITED: exited}


def signal_stacks(root: Path, ranks: list[int]) -> dict[str, Any]:
    """Signal the faulthandler of each armed rank that has not answered (POST
    /v1/stacks/signal)."""
    folder = root / EVIDENCE_DIR
    signalled = []
    for rank in ranks:
        if not answer_path(folder, rank).exists() and signal_faulthandler(folder, rank):
            signalled.append(rank)
    return {wire.SIGNALLED: signalled}
