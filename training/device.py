"""Where a rank computes: the process-group backend and the device (gloo/CPU, NCCL/GPU)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class BackendError(RuntimeError):
    """The backend a job asks for cannot run here."""


def choose_backend(requested: str = "auto") -> str:
    """Return ``nccl`` or ``gloo`` for the spec's ``backend`` (``auto`` picks by hardware)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    has_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if requested == "gloo":
        return "gloo"
    if requested == "nccl":
        if not has_gpus or not dist.is_nccl_available():
            raise BackendError(
                f"backend: expected {local_world} CUDA device(s) with NCCL for `backend: nccl`;"
                f" found {torch.cuda.device_count()} device(s), NCCL "
                f"{'available' if dist.is_nccl_available() else 'not built in'}. "
                "Run on GPU nodes, or set `backend: auto` or `backend: gloo` in the job spec.")
        return "nccl"
    return "nccl" if has_gpus and dist.is_nccl_available() else "gloo"


def wait_for_compute() -> None:
    """Wait until this rank's queued GPU kernels are done (no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
