"""One rank's training loop over the segment's steps ``[start_step, end_step)``.

Started by a node agent with ``RANK``, ``LOCAL_RANK`` and ``RELAY_NODE`` set;
everything else comes from the launch file. Every RNG draw is a function of
(seed, step, rank) and the gradient all-reduce sums ranks in a fixed order, so
resuming from a checkpoint reproduces an uninterrupted run bit for bit.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from training.chaos import ChaosMonkey
from training.checkpoint import Checkpointer, load_verified, restore_rng, snapshot
from training.data import CharStream, load_corpus, mix_seed
from training.heartbeat import ENV_NODE, HeartbeatWriter, Phase
from training.launch import DRAIN_FILE, FIRST_STEP_FILE, LaunchConfig
from training.manifest import CheckpointRef
from training.model import ModelConfig, build_model
from training.rescue import RescueResponder, TrainingState

log = logging.getLogger("training.worker")
# Freeing DDP's reducer can deadlock with gloo: ~ProcessGroupGloo waits for a work thread
# that needs the GIL to free the last all-gather's tensors, while the freeing thread holds
# it (seen as a rank stuck at exit after its segment). The objects stay referenced here and
# the process leaves through exit_now(), which skips tearing them down.
_KEEP_ALIVE: list[Any] = []
ENV_INIT_METHOD = "RELAY_INIT_METHOD"
# The first steps of an attempt warm up (allocations, DDP's bucket rebuild after step one):
# they are not the rank's natural pace, which chaos stragglers are scaled by.
WARMUP_STEPS = 2
ENV_SPAWNED_AT = "RELAY_SPAWNED_AT"  # set by the node agent: time.time() when it started us


def ordered_allreduce_hook(
    heartbeat: HeartbeatWriter, clock: dict[str, float]
) -> Any:  # noqa: ANN401 - DDP's hook type is private
    """Return a DDP comm hook that averages gradients summing ranks in rank order.

    gloo's ring all-reduce adds ranks in an order that depends on where an
    element sits in the bucket, and DDP rebuilds buckets after the first step,
    so a resumed run could differ in the last bit. All-gather, then a sum in
    rank order, is the same for every layout. The hook is also the moment the
    rank finished computing: it stamps the heartbeat's compute time.
    """

    # DDP inspects the hook's annotations at runtime, and with postponed
    # evaluation they are strings it rejects; so this one stays unannotated.
    def hook(_state, bucket):  # noqa: ANN001, ANN202
        if "compute_done" not in clock:
            clock["compute_done"] = time.perf_counter()
            heartbeat.enter(Phase.COLLECTIVE)
        buf = bucket.buffer()
        world = dist.get_world_size()
        parts = [torch.empty_like(buf) for _ in range(world)]
        fut = dist.all_gather(parts, buf, async_op=True).get_future()

        def reduce(done: torch.futures.Future[Any]) -> torch.Tensor:
            done.value()  # re-raise a failed all-gather; never sum uninitialised buffers
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            return total.div_(world)

        return fut.then(reduce)

    return hook


def _publisher(cfg: LaunchConfig, parent: CheckpointRef | None) -> tuple[Checkpointer, Any]:
    from training.publish import MlflowCheckpointSink  # rank 0 only: keeps other ranks light

    sink = MlflowCheckpointSink(cfg.tracking_uri, cfg.run_id)
    checkpointer = Checkpointer(
        sink, cfg.root / "staging", job=cfg.job, world_size=cfg.world_size, parent=parent
    )
    checkpointer.submit(sink.connect)  # beside the loop, long before the first checkpoint
    return checkpointer, sink


class StartupClock:
    """Seconds spent in each start-up phase, for one log line (what a resume costs)."""

    def __init__(self) -> None:
        spawned = os.environ.get(ENV_SPAWNED_AT)
        self.origin = float(spawned) if spawned else time.time()
        self.last = self.origin
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """Close ``phase`` now."""
        now = time.time()
        self.phases[phase] = now - self.last
        self.last = now

    def summary(self) -> str:
        """Return e.g. ``5.10s (imports 2.31s, rendezvous 1.20s, ...)``."""
        parts = ", ".join(f"{k} {v:.2f}s" for k, v in self.phases.items())
        return f"{self.last - self.origin:.2f}s ({parts})"


def train(
    cfg: LaunchConfig, rank: int, node: str, startup: StartupClock | None = None
) -> None:
    """Run this rank's part of the segment."""
    startup = startup or StartupClock()
    torch.set_num_threads(1)
    chaos = ChaosMonkey(
        cfg.chaos, segment=cfg.segment, attempt=cfg.attempt, rank=rank, node=node,
        record_dir=cfg.root,
    )
    chaos.at_startup()
    heartbeat = HeartbeatWriter(
        cfg.heartbeat_dir, rank, node, cfg.heartbeat_interval_seconds, step=cfg.start_step
    )
    heartbeat.start()
    dist.init_process_group(
        "gloo",
        # torchrun (the benchmark's baseline) hands out its own rendezvous: env://
        init_method=os.environ.get(ENV_INIT_METHOD) or f"tcp://{cfg.master_addr}:{cfg.master_port}",
        rank=rank,
        world_size=cfg.world_size,
        timeout=timedelta(seconds=cfg.collective_timeout_seconds),
    )
    startup.mark("rendezvous")
    model_cfg = ModelConfig(**cfg.model)
    model = build_model(model_cfg, cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), **cfg.optimizer)
    parent: CheckpointRef | None = None
    if cfg.resume is not None:
        state = load_verified(Path(cfg.resume.path), cfg.resume.sha256)
        if int(state["step"]) != cfg.start_step:
            raise RuntimeError(
                f"checkpoint {cfg.resume.path}: expected step {cfg.start_step}, "
                f"found {state['step']}; the launcher and the checkpoint disagree"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        restore_rng(state)
        parent = CheckpointRef(cfg.resume.run_id, cfg.resume.step, cfg.resume.sha256)
        log.info("rank %d resumed from step %d (%s)", rank, cfg.start_step, cfg.resume.path)
    startup.mark("restore")

    clock: dict[str, float] = {}
    # One bucket for all gradients, so the hook fires once, when backward is done;
    # no buffer sync in forward (the only buffer is a constant mask), so the forward pass
    # holds no collective and "compute" really is local work.
    ddp = DistributedDataParallel(model, bucket_cap_mb=1024, forward_sync_buffers=False)
    _KEEP_ALIVE.append(ddp)  # see exit_now()
    ddp.register_comm_hook(None, ordered_allreduce_hook(heartbeat, clock))
    stream = CharStream(
        load_corpus(cfg.data["corpus"]), model_cfg.context, cfg.data["batch_size"], cfg.seed
    )
    checkpointer, sink = _publisher(cfg, parent) if rank == 0 else (None, None)
    startup.mark("setup")
    pending_metrics: list[tuple[int, dict[str, float], int]] = []
    heartbeat.beat(step=cfg.start_step)

    def extra(step: int) -> dict[str, Any]:
        return {"data": {"position": step, "seed": cfg.seed}, "world_size": cfg.world_size}

    state = TrainingState(cfg.start_step)
    responder = RescueResponder(
        cfg.root, rank, state, lambda step: snapshot(model, optimizer, step, extra(step))
    )
    responder.start()
    compute_avg = Ewma()
    natural_avg = Ewma()  # compute time without injected delays (chaos scales by it)
    rate_avg = Ewma()
    finite = True  # False once a non-finite loss was seen: never checkpoint poisoned weights
    loop_started = time.perf_counter()

    drain = DrainRequest(cfg.root / DRAIN_FILE)
    end_step = cfg.end_step
    for step in range(cfg.start_step, cfg.end_step):
        stop_at = drain.stop_at()
        if stop_at is not None and step >= stop_at:
            end_step = step
            log.warning("rank %d drained at step %d: checkpointing and leaving", rank, step)
            break
        chaos.before_step(step)
        torch.manual_seed(mix_seed(cfg.seed, step, rank))
        inputs, targets = stream.batch(step, rank)
        heartbeat.enter(Phase.COMPUTE)
        clock.clear()
        started = time.perf_counter()
        injected = chaos.delay(step, natural_avg.value or 0.0)
        logits = ddp(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss = chaos.corrupt_loss(step, loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        loss_value = float(loss.item())
        newly_poisoned = finite and not math.isfinite(loss_value)
        finite = finite and not newly_poisoned
        with state.lock:  # a rescue snapshot sees the weights and the count move together
            optimizer.step()
            state.completed, state.finite = step + 1, finite
        done = time.perf_counter()
        computed = clock.get("compute_done", done) - started
        if step >= cfg.start_step + WARMUP_STEPS:
            natural_avg.add(computed - injected)
        heartbeat.beat(
            step=step + 1,
            compute_seconds=compute_avg.add(computed),
            samples_per_second=rate_avg.add(
                stream.batch_size * cfg.world_size / max(done - started, 1e-9)
            ),
            loss=loss_value,
        )
        if step == cfg.start_step:
            startup.mark("first step")
            log.info("rank %d productive after %s", rank, startup.summary())
        if newly_poisoned:
            # Say it now: the first rank to report a non-finite loss is the culprit.
            heartbeat.flush_now()
        if checkpointer is None:
            continue
        if step == cfg.start_step:  # when the attempt became productive (time to resume)
            first = {"step": step + 1, "at": time.time(), "node": node,
                     "spawned_at": startup.origin, "startup": startup.phases}
            (cfg.root / FIRST_STEP_FILE).write_text(json.dumps(first))
        rate = rate_avg.value or 0.0
        pending_metrics.append(
            (step + 1, {"loss": loss_value, "samples_per_second": rate}, int(time.time() * 1000))
        )
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 in (cfg.end_step, drain.last):
            if not finite:
                log.error("step %d: loss is not finite; not checkpointing poisoned weights",
                          step + 1)
                continue
            heartbeat.enter(Phase.CHECKPOINT)
            stats = checkpointer.save(model, optimizer, step + 1, extra(step + 1))
            log.info("step %d loss %.4f checkpoint stall %.4fs", step + 1, loss_value,
                     stats.stall_seconds)
            batch, pending_metrics = pending_metrics, []
            checkpointer.submit(lambda batch=batch: _log_metrics(sink, batch))

    loop_seconds = time.perf_counter() - loop_started
    responder.close()
    if checkpointer is not None:
        checkpointer.close()
        steps = end_step - cfg.start_step
        result = {"steps": steps, "loop_seconds": loop_seconds,
                  "steps_per_second": steps / loop_seconds if loop_seconds > 0 else 0.0}
        (cfg.root / "result.json").write_text(json.dumps(result))
    heartbeat.close()
    dist.destroy_process_group()


class DrainRequest:
    """Relay's request to stop at a given step after checkpointing (checkpoint_and_migrate).

    Relay picks a step at least two ahead of the fastest rank; ranks never drift
    more than one step apart (every step ends in an all-reduce), so every rank
    reads the request before reaching that step and all stop at the same one.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.last: int | None = None

    def stop_at(self) -> int | None:
        """Return the step to stop at, once requested (one stat() per step otherwise)."""
        if self.last is None and self.path.exists():
            try:
                self.last = int(json.loads(self.path.read_text())["stop_at"])
            except (OSError, ValueError, KeyError, TypeError):
                return None  # being written: read it next step
        return self.last


class Ewma:
    """An exponentially weighted moving average (recent steps count most)."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, sample: float) -> float:
        """Fold in one sample and return the average."""
        self.value = sample if self.value is None else (
            self.alpha * sample + (1 - self.alpha) * self.value
        )
        return self.value


def _log_metrics(sink: Any, batch: list[tuple[int, dict[str, float], int]]) -> None:  # noqa: ANN401
    for step, values, ts in batch:
        sink.log_metrics(step, values, ts)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m training.worker --launch FILE``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--launch", type=Path, required=True)
    args = parser.parse_args(argv)
    rank = int(os.environ["RANK"])
    node = os.environ[ENV_NODE]
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {node} rank{rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,  # forked by the node agent: replace the agent's handler
    )
    startup = StartupClock()
    startup.mark("imports")
    train(LaunchConfig.read(args.launch), rank, node, startup)
    return 0


def exit_now(code: int) -> None:
    """Leave the process at once: flush logs and stdio, skip interpreter teardown.

    Everything that matters (checkpoints, result.json, the last heartbeat) is
    written before ``train`` returns; see ``_KEEP_ALIVE`` for why teardown is skipped.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
