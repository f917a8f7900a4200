"""Checkpoints on the worker side: snapshot, save and publish to MLflow, fetch, verify, load.

``checkpointer`` takes the in-memory snapshot and saves and publishes it beside the
training loop; ``dcp`` does the same for sharded ``torch.distributed.checkpoint``
folders; ``publish`` is the MLflow side of it (retried at the I/O edge); ``fetch``
brings a rank its resume checkpoint from MLflow's artifact store.
"""
