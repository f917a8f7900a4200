"""The training loop with no Relay code at all: `relay bench overhead`'s reference.

The same model, data, optimizer, per-step seeding and loss read-out as
``relay_train.examples.charlm`` (the built-in job, through Relay's worker API),
under plain DDP (default buckets, gloo's own all-reduce); no heartbeat thread,
comm hook, rescue responder, drain check, chaos check or checkpointer. Run under torchrun:
``torchrun --standalone --nproc-per-node 4 -m relay_train.baselines.bare_worker --launch FILE``.
Rank 0 writes ``result.json`` (steps, loop seconds, steps/s) in the launch's
attempt folder, like the Relay loop. ``--relay-ddp`` adds exactly one piece of
Relay back - its DDP set-up and comm hook (one bucket, all-gather then a sum in
rank order, for bit-exact resumes) - so the benchmark can tell that piece's
cost from the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from relay_train.examples.data import CharStream, load_corpus, mix_seed
from relay_train.examples.transformer import ModelConfig, build_model
from relay_train.protocol.launch import LaunchConfig


def _relay_ddp(module: torch.nn.Module) -> DistributedDataParallel:
    from relay_train.reduce import comm_hook  # the hook Session.comm_hook(ordered=True) returns

    ddp = DistributedDataParallel(module, bucket_cap_mb=1024, forward_sync_buffers=False)
    ddp.register_comm_hook(None, comm_hook(lambda: None, ordered=True))  # no phase marks
    return ddp


def train(cfg: LaunchConfig, rank: int, relay_ddp: bool = False) -> None:
    """Train steps ``[start_step, end_step)`` and nothing else."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    model_cfg = ModelConfig(**cfg.model)
    module = build_model(model_cfg, cfg.seed)
    model = _relay_ddp(module) if relay_ddp else DistributedDataParallel(module)
    optimizer = torch.optim.AdamW(model.parameters(), **cfg.optimizer)
    stream = CharStream(
        load_corpus(cfg.data["corpus"]), model_cfg.context, cfg.data["batch_size"], cfg.seed
    )
    started = time.perf_counter()
    for step in range(cfg.start_step, cfg.end_step):
        torch.manual_seed(mix_seed(cfg.seed, step, rank))
        inputs, targets = stream.batch(step, rank)
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        float(loss.item())  # the Relay loop reads the loss every step too
        optimizer.step()
    seconds = time.perf_counter() - started
    if rank == 0:
        steps = cfg.end_step - cfg.start_step
        result = {"steps": steps, "loop_seconds": seconds, "steps_per_second": steps / seconds}
        (cfg.root / "result.json").write_text(json.dumps(result))
    dist.barrier()


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``torchrun ... -m relay_train.baselines.bare_worker --launch FILE``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--launch", type=Path, required=True)
    parser.add_argument("--relay-ddp", action="store_true",
                        help="use Relay's DDP buckets and ordered all-gather comm hook")
    args = parser.parse_args(argv)
    train(LaunchConfig.read(args.launch), int(os.environ["RANK"]), args.relay_ddp)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip gloo's teardown, as the Relay loop does (see relay_train.worker)
