"""What a node agent imports once, before it forks its ranks (they then skip those
seconds of start-up): torch, the training loop, the optimizer's lazy imports and,
on a node that publishes or fetches checkpoints, MLflow and its tracking store."""

from __future__ import annotations

import importlib

from relay_train.protocol.launch import BUILTIN_ENTRYPOINT, Entrypoint


def preload_worker(entrypoint: Entrypoint, *, publisher: bool,
                   tracking_uri: str | None = None) -> None:
    """Import what the ranks need, without running anything: torch, the API, the example.

    Constructing a torch optimizer imports ``torch._dynamo`` (about a second of
    CPU); MLflow and its tracking store for ``tracking_uri`` (``None``: not known
    yet) are rank 0's, for publishing checkpoints. A user's module is not
    imported (its top level is theirs to run, as ``__main__``, in the rank). No
    thread is started, no OpenMP region runs and CUDA is not touched, so forking
    afterwards is safe.
    """
    import torch

    import relay_train.api  # noqa: F401 - the import is the point

    torch.set_num_threads(1)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    if entrypoint.module == BUILTIN_ENTRYPOINT:
        importlib.import_module(BUILTIN_ENTRYPOINT)
    if publisher:
        preload_publisher(tracking_uri)


def preload_publisher(tracking_uri: str | None) -> None:
    """Import MLflow and the tracking store that ``tracking_uri`` opens."""
    from relay_train.checkpoints.publish import preload_store

    preload_store(tracking_uri)
