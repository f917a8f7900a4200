"""The built-in example: a character transformer trained with DDP, through the public API.

A job spec without an ``entrypoint`` runs this. It uses nothing of Relay's but
``relay_train``'s public surface (its hyperparameters come from the spec's
``model``, ``data`` and ``optimizer`` sections through ``session.job_config``).
Every RNG draw is a function of (seed, step, rank) and gradients are summed in
rank order, so a run resumed from any checkpoint ends bit for bit where an
uninterrupted one does.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

import relay_train
from relay_train.examples.data import CharStream, load_corpus
from relay_train.examples.transformer import ModelConfig, build_model


def main() -> None:
    """Train this rank's part of the segment."""
    session = relay_train.init()
    torch.set_num_threads(1)
    session.init_process_group()
    config = session.job_config
    model_cfg = ModelConfig(**config["model"])
    model = build_model(model_cfg, session.seed).to(session.device)
    optimizer = torch.optim.AdamW(model.parameters(), **config["optimizer"])
    session.track(lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    state = session.resume_state()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    # One bucket for all gradients, so the hook fires once, when backward is done; no buffer
    # sync in forward (the only buffer is a constant mask), so "compute" is local work only.
    ddp = DistributedDataParallel(model, bucket_cap_mb=1024, forward_sync_buffers=False,
                                  **session.ddp_kwargs)
    ddp.register_comm_hook(None, session.comm_hook(ordered=True))
    stream = CharStream(load_corpus(config["data"]["corpus"]), model_cfg.context,
                        config["data"]["batch_size"], session.seed)
    for step in session.steps():
        relay_train.seed_step(session.seed, step, session.rank)
        inputs, targets = (t.to(session.device) for t in stream.batch(step, session.rank))
        logits = ddp(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        with session.update(step):
            optimizer.step()
        session.report(step, loss=loss.item(), samples=stream.batch_size)
    session.close()


if __name__ == "__main__":
    main()
