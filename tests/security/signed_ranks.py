"""Rank programs for the signed-checkpoint tests: real Sessions over gloo on CPU.

Each rank builds :class:`relay_train.api.Session` from a launch config (as under Relay's
node agent), joins the process group, and saves or resumes through the Session's own
API: ``save`` / ``resume_state`` (one ``torch.save`` file) and ``save_sharded`` /
``resume_sharded`` (a ``torch.distributed.checkpoint`` folder). Started with
``torch.multiprocessing.start_processes``; each rank writes what happened to
``rank{r}-outcome.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from relay_train.api import Session
from relay_train.errors import CorruptCheckpointError
from relay_train.protocol.launch import LaunchConfig

WORLD_SIZE = 2


def _session(rank: int, launch: dict[str, Any]) -> Session:
    cfg = LaunchConfig.from_dict(launch)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cfg.master_port),
                       "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    session = Session(cfg, rank, cfg.nodes[0])
    session.init_process_group()
    return session


def model_state(step: int) -> dict[str, Any]:
    """Return the state every rank holds after ``step`` steps (the same on every rank)."""
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 2)
    return {"model": model.state_dict(), "note": torch.tensor(step)}


def save_ranks(rank: int, launch: dict[str, Any], steps: list[int], sharded: bool) -> None:
    """Save a checkpoint after each of ``steps`` through the Session, then close it."""
    session = _session(rank, launch)
    for step in steps:
        state = model_state(step)
        if sharded:
            session.save_sharded(step, state)
        else:
            session.save(step, state)
    session.close()


def resume_ranks(rank: int, launch: dict[str, Any], sharded: bool) -> None:
    """Resume through the Session from the launch config's resume point; record the outcome."""
    session = _session(rank, launch)
    out = Path(launch["attempt_dir"]) / f"rank{rank}-outcome.json"
    try:
        if sharded:
            state = {"model": torch.nn.Linear(4, 2).state_dict(), "note": torch.tensor(-1)}
            session.resume_sharded(state)
        else:
            loaded = session.resume_state()
            assert loaded is not None
            state = loaded
        outcome = {"loaded": int(state["note"]),
                   "weights": state["model"]["weight"].flatten().tolist()}
    except CorruptCheckpointError as exc:
        outcome = {"refused": str(exc)}
    out.write_text(json.dumps(outcome))
    session.close()


def resume_each(rank: int, launches: list[dict[str, Any]], sharded: bool) -> None:
    """:func:`resume_ranks` for each launch in turn, in one process per rank (a new Session
    and process group each): one interpreter start-up, torch imported once, for them all."""
    for launch in launches:
        resume_ranks(rank, launch, sharded)
