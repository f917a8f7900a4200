"""Rank programs for the DCP checkpoint tests: a tiny FSDP2 model over gloo on CPU.

``save_ranks`` trains, saves DCP checkpoints (async) to a real MLflow store and dumps
each rank's local shards; ``resume_ranks`` loads checkpoints through ``relay_train.checkpoints.dcp``
and dumps what it loaded. Started with ``torch.multiprocessing.start_processes``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from relay.core.checkpoint_keys import checkpoint_keys
from relay_train.checkpoints.checkpointer import Checkpointer
from relay_train.checkpoints.dcp import DcpCheckpointer, load_model
from relay_train.errors import CorruptCheckpointError
from relay_train.protocol.launch import ResumeFrom

KEYS = checkpoint_keys()  # the test session's key ring ($RELAY_HOME's key file)

WORLD_SIZE = 2
JOB = "dcp-test"


def _join(rank: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD_SIZE, timeout=timedelta(seconds=120))


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(1000 * step + dist.get_rank())
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _local(obj: Any) -> Any:  # noqa: ANN401
    """Return a copy with every DTensor replaced by this rank's shard."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_local(v) for v in obj]
    return obj


def _dump(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    torch.save({"model": _local(model.state_dict()), "optimizer": _local(optimizer.state_dict())},
               path)


def save_ranks(rank: int, port: int, work: str, tracking_uri: str, run_id: str) -> None:
    """Train 5 steps, save DCP checkpoints after steps 2 and 4, dump shards at 2, 4, 5."""
    _join(rank, port)
    out = Path(work)
    model, optimizer = _model(seed=0)
    publisher = None
    if rank == 0:
        from relay_train.checkpoints.publish import (
            MlflowCheckpointSink,  # only rank 0 talks to MLflow
        )

        sink = MlflowCheckpointSink(tracking_uri, run_id)
        publisher = Checkpointer(sink, out / "staging", job=JOB, world_size=WORLD_SIZE,
                                 parent=None, keys=KEYS)
    saver = DcpCheckpointer(out / "staging", publisher)
    for step in range(1, 6):
        _train_step(model, optimizer, step)
        _dump(model, optimizer, out / f"rank{rank}-step{step}.pt")
        if step in (2, 4):
            # Training goes on at once: the checkpoint must still hold this step's state.
            saver.save_model(model, optimizer, step, {"note": f"step {step}"})
    saver.close()
    if publisher is not None:
        publisher.close()
        (out / "published.json").write_text(json.dumps(
            [{"step": m.step, "format": m.format, "files": m.files,
              "parent": m.parent.step if m.parent else None} for m in publisher.published]))
    dist.destroy_process_group()


def resume_ranks(rank: int, port: int, work: str, points: dict[str, dict[str, Any]]) -> None:
    """Try every resume point in ``points`` on a fresh model; dump what loaded or the error."""
    _join(rank, port)
    out = Path(work)
    outcome: dict[str, str] = {}
    for name, fields in points.items():
        model, optimizer = _model(seed=123)  # different weights than the saved run
        try:
            state = load_model(ResumeFrom(**fields), model, optimizer, {"note": ""})
        except CorruptCheckpointError as exc:
            outcome[name] = f"refused: {exc}"
            continue
        outcome[name] = f"loaded: {state['note']}"
        _dump(model, optimizer, out / f"rank{rank}-{name}-loaded.pt")
        step = int(fields["step"])
        _train_step(model, optimizer, step + 1)
        _dump(model, optimizer, out / f"rank{rank}-{name}-trained.pt")
    (out / f"rank{rank}-outcome.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


def resume_fields(resume: ResumeFrom) -> dict[str, Any]:
    """Return a resume point as plain data for a spawned rank."""
    return asdict(resume)
