"""`relay bench checkpoint`: how long the training loop stalls per checkpoint, async vs sync.

One process, one model, two checkpointers publishing to a real MLflow store
(SQLite + local artifacts in a temp folder), interleaved so both see the same
machine load. Sync: the loop waits for snapshot + torch.save + sha256 + MLflow
upload. Async: the loop waits for the in-memory snapshot only.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from mlflow.tracking import MlflowClient

from training.checkpoint import Checkpointer
from training.data import CharStream, load_corpus, mix_seed
from training.model import ModelConfig, build_model
from training.publish import MlflowCheckpointSink


def _train_steps(
    model: torch.nn.Module, opt: torch.optim.Optimizer, stream: CharStream, first: int, n: int
) -> float:
    started = time.perf_counter()
    for step in range(first, first + n):
        torch.manual_seed(mix_seed(stream.seed, step))
        x, y = stream.batch(step, 0)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - started) / n


def main(
    checkpoints: int = 8, d_model: int = 512, n_layers: int = 8, steps_between: int = 2
) -> int:
    """Run the benchmark and print the figures."""
    torch.set_num_threads(1)
    cfg = ModelConfig(d_model=d_model, n_layers=n_layers, n_heads=8, context=64)
    model = build_model(cfg, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stream = CharStream(load_corpus("builtin:python_docs"), cfg.context, 8, seed=1)
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="relay-bench-") as tmp:
        root = Path(tmp)
        uri = f"sqlite:///{root / 'mlflow.db'}"
        client = MlflowClient(uri)
        exp = client.create_experiment("bench", artifact_location=(root / "artifacts").as_uri())
        checkpointers = {}
        for mode in ("sync", "async"):
            run_id = client.create_run(exp, run_name=mode).info.run_id
            checkpointers[mode] = Checkpointer(
                MlflowCheckpointSink(uri, run_id), root / mode, job="bench", world_size=1,
                parent=None, asynchronous=(mode == "async"),
            )
        stalls: dict[str, list[float]] = {"sync": [], "async": []}
        step_times: list[float] = []
        step = 0
        _train_steps(model, opt, stream, step, 1)  # create optimizer state before measuring
        for i in range(checkpoints):
            order = ("sync", "async") if i % 2 == 0 else ("async", "sync")
            for mode in order:
                step_times.append(_train_steps(model, opt, stream, step, steps_between))
                step += steps_between
                stats = checkpointers[mode].save(model, opt, step, {"data": {"position": step}})
                stalls[mode].append(stats.stall_seconds)
        drain_started = time.perf_counter()
        for ckpt in checkpointers.values():
            ckpt.close()
        drain = time.perf_counter() - drain_started
        size_mb = checkpointers["sync"].published[-1].size_bytes / 1e6
        published = {m: len(c.published) for m, c in checkpointers.items()}

    sync_med = statistics.median(stalls["sync"])
    async_med = statistics.median(stalls["async"])
    print(f"Checkpoint stall benchmark: {params / 1e6:.1f}M parameters, "
          f"checkpoint {size_mb:.0f} MB, {checkpoints} checkpoints per mode, interleaved")
    print(f"  training step (1 thread):   {statistics.median(step_times) * 1000:8.1f} ms median")
    print(f"  {'mode':6} {'median stall':>14} {'max stall':>12} {'published':>10}")
    for mode in ("sync", "async"):
        print(f"  {mode:6} {statistics.median(stalls[mode]) * 1000:11.1f} ms "
              f"{max(stalls[mode]) * 1000:9.1f} ms {published[mode]:>10}")
    ratio = async_med / sync_med
    print(f"  async stall / sync stall:  {ratio:.1%} (goal <= 10%)")
    print(f"  async backlog drained at the end in {drain:.2f}s")
    return 0 if published["async"] == checkpoints == published["sync"] else 1
