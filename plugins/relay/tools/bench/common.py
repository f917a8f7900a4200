"""What the benchmarks share: a throwaway MLflow store and segment launches without Airflow."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from relay.core.attempt import Attempt
from relay.core.checkpoint_keys import checkpoint_keys
from relay.launchers.local.launcher import LocalLauncher
from relay.policy.model import Detection
from relay.watch.triggers import SegmentWatchTrigger
from relay_train.protocol.launch import LaunchConfig

TINY_MODEL = {"context": 32, "d_model": 32, "n_layers": 1, "n_heads": 4, "dropout": 0.1}


class Store:
    """A local MLflow store with one experiment; each launch gets a fresh run."""

    def __init__(self, root: Path) -> None:
        self.uri = f"sqlite:///{root / 'mlflow.db'}"
        self.client = MlflowClient(self.uri)
        self.experiment = self.client.create_experiment(
            "bench", artifact_location=(root / "artifacts").as_uri()
        )

    def new_run(self) -> str:
        """Create a run for one launch."""
        return str(self.client.create_run(self.experiment).info.run_id)


def launch_config(
    store: Store,
    attempt_dir: Path,
    *,
    steps: int,
    chaos: list[dict[str, Any]] | None = None,
    heartbeat_interval: float = 0.5,
    checkpoint_every: int = 10**9,
    model: dict[str, Any] | None = None,
    batch_size: int = 8,
) -> LaunchConfig:
    """Return a 2-node x 2-rank launch of the tiny model."""
    return LaunchConfig(
        job="bench", seed=1, model=model or TINY_MODEL,
        data={"corpus": "builtin:python_docs", "batch_size": batch_size},
        optimizer={"lr": 0.003}, start_step=0, end_step=steps, checkpoint_every=checkpoint_every,
        nodes=["node-a", "node-b"], ranks_per_node=2, master_addr="127.0.0.1",
        tracking_uri=store.uri, run_id=store.new_run(),
        attempt_dir=str(attempt_dir), attempt=1, segment=0,
        heartbeat_interval_seconds=heartbeat_interval, chaos=chaos or [],
        checkpoint_keys=checkpoint_keys().to_dict(),
    )


def node_ranks(cfg: LaunchConfig) -> dict[str, list[int]]:
    """Return the global ranks of each node."""
    return {n: [cfg.global_rank(n, r) for r in range(cfg.ranks_per_node)] for n in cfg.nodes}


async def _first_event(trigger: SegmentWatchTrigger, timeout: float) -> dict[str, Any]:
    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return dict(event.payload)
        raise RuntimeError("the trigger ended without an event")

    return await asyncio.wait_for(first(), timeout)


def watch(cfg: LaunchConfig, detection: Detection, timeout: float,
          boundary_step: int | None = None,
          launcher: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the real segment watcher on a launch (by ``launcher``, a launcher's config; None:
    the local one) until its first event."""
    trigger = SegmentWatchTrigger(launcher=launcher,
        attempt_dir=cfg.attempt_dir, node_ranks=node_ranks(cfg),
        detection=detection.model_dump(), heartbeat_interval_seconds=cfg.heartbeat_interval_seconds,
        poll_interval_seconds=detection.poll_interval, boundary_step=boundary_step,
    )
    try:
        return asyncio.run(_first_event(trigger, timeout))
    except TimeoutError:
        return {"status": "timeout"}


@contextmanager
def launched(cfg: LaunchConfig) -> Iterator[Attempt]:
    """Launch a segment and always stop every process of it afterwards."""
    launcher = LocalLauncher()
    root = launcher.launch(cfg)
    try:
        yield root
    finally:
        survivors = launcher.stop(root, grace_seconds=2.0)
        if survivors:
            raise RuntimeError(f"processes {survivors} survived stopping {root}")


def summary(values: list[float]) -> tuple[float, float]:
    """Return (median, max), or NaN for no values."""
    if not values:
        return float("nan"), float("nan")
    return statistics.median(values), max(values)
