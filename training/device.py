"""Where a rank computes and how it talks: NCCL on one GPU per ``LOCAL_RANK``, or gloo on CPU.

Torch and the standard library only. The node agent calls
:func:`rank_environment` and :func:`rank_start_method` before it starts its
ranks, and never queries CUDA itself: ``torch.cuda.is_available()`` calls
``cuInit``, after which a forked child cannot use CUDA, yet
``torch.cuda.is_initialized()`` still says False. So the backend is resolved
in the rank, after the fork, by :func:`setup_rank_device`.

What Relay sets for ranks, and why (PyTorch 2.13, ``ProcessGroupNCCL.hpp`` and
``FlightRecorder.hpp`` in the installed headers; the "ProcessGroupNCCL
Environment Variables" page of the PyTorch docs):

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (tear the process down without aborting
  the communicator; the documented default, pinned so a node's own setting
  cannot turn it off): a failed or timed-out collective ends the rank, which the
  agent reports, instead of hanging. Mode 1 aborts the communicator first and
  loses the Flight Recorder dump (pytorch/pytorch#121055).
- ``TORCH_NCCL_BLOCKING_WAIT=0``: ``wait()`` stays non-blocking; the watchdog
  thread, not the training thread, times collectives out.
- ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` with ``TORCH_NCCL_ENABLE_MONITORING=1`` and a
  non-zero ``TORCH_FR_BUFFER_SIZE``: on a watchdog timeout each rank writes its
  Flight Recorder trace to ``TORCH_FR_DUMP_TEMP_FILE`` + its rank, which Relay
  points into the attempt folder (the default is ``/tmp``, lost with the pod).
- ``TORCH_FR_BUFFER_SIZE``/``TORCH_FR_DUMP_TEMP_FILE`` for gloo too: torch 2.13
  records gloo collectives in the Flight Recorder as well.
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when bit-exact resume is asked for: cuBLAS
  reads it when its handle is created, so it must be in the environment before
  the rank touches CUDA, and ``torch.use_deterministic_algorithms(True)`` raises
  on cuBLAS calls without it.
- ``CUDA_DEVICE_MAX_CONNECTIONS`` is left alone: setting it to 1 only orders
  kernels for tensor-parallel communication overlap (Megatron-style); for DDP it
  would serialise compute and gradient all-reduce queues and slow steps down.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relay_train.errors import DeviceError

log = logging.getLogger(__name__)

FLIGHT_RECORDER_DIR = "flight_recorder"  # in the attempt folder; files rank_<RANK>
FLIGHT_RECORDER_ENTRIES = 2000  # PyTorch's own default and its recommended size
CUBLAS_DETERMINISTIC = ":4096:8"


class Backend(StrEnum):
    """A job spec's ``backend``: ``auto`` picks NCCL when every local rank gets a GPU."""

    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


@dataclass(frozen=True)
class RankDevice:
    """What one rank computes on and which process-group backend it joins."""

    backend: str  # "gloo" or "nccl", as init_process_group takes it
    device: torch.device
    deterministic: bool = False  # deterministic algorithms were turned on (CUDA only)
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)


class PlacedRank:
    """``backend``, ``device`` and ``ddp_kwargs`` of a session, from its ``placement``."""

    placement: RankDevice  # a property of the session: set up once, after the fork

    @property
    def backend(self) -> str:
        """Return the process-group backend to use: ``nccl`` on GPUs, ``gloo`` on CPUs."""
        return self.placement.backend

    @property
    def device(self) -> torch.device:
        """Return this rank's device: ``cuda:LOCAL_RANK`` with NCCL, else the CPU."""
        return self.placement.device

    @property
    def ddp_kwargs(self) -> dict[str, Any]:
        """Return the DDP arguments for this rank's device (``device_ids`` on CUDA)."""
        return dict(self.placement.ddp_kwargs)


def nccl_usable(local_world_size: int) -> tuple[bool, str]:
    """Return whether NCCL can give each of ``local_world_size`` ranks its own GPU, and why."""
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible (torch.cuda.is_available() is False)"
    found = torch.cuda.device_count()
    if found < local_world_size:
        return False, f"{found} CUDA device(s) for {local_world_size} local rank(s)"
    if not dist.is_nccl_available():
        return False, "this torch build has no NCCL (torch.distributed.is_nccl_available())"
    return True, f"{found} CUDA device(s) for {local_world_size} local rank(s), NCCL available"


def resolve_backend(requested: str, local_world_size: int) -> str:
    """Turn a spec's ``auto|gloo|nccl`` into the backend this rank really uses."""
    try:
        wanted = Backend(requested)
    except ValueError:
        raise DeviceError(
            f"backend: expected one of auto, gloo, nccl; found {requested!r}; "
            "fix: set backend to auto (NCCL on GPUs, else gloo), gloo or nccl"
        ) from None
    if wanted is Backend.GLOO:
        return Backend.GLOO.value
    usable, why = nccl_usable(local_world_size)
    if usable:
        return Backend.NCCL.value
    if wanted is Backend.NCCL:
        raise DeviceError(
            f"backend: nccl: expected a CUDA build of torch with NCCL and at least "
            f"{local_world_size} GPU(s) on this node (one per local rank); found {why}; "
            "fix: run on GPU nodes (check with `relay doctor`), lower ranks_per_node to the "
            "number of GPUs per node, or set backend: auto (or gloo) to train on CPU"
        )
    log.info("backend auto: gloo on CPU (%s)", why)
    return Backend.GLOO.value


def rank_device(backend: str, local_rank: int) -> torch.device:
    """Return this rank's device; under NCCL, make ``cuda:LOCAL_RANK`` the current device."""
    if backend != Backend.NCCL:
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def ddp_kwargs(device: torch.device) -> dict[str, Any]:
    """Return DistributedDataParallel's device arguments: one GPU per process, none on CPU."""
    if device.type != "cuda":
        return {}
    return {"device_ids": [device.index], "output_device": device.index}


def enable_determinism(device: torch.device) -> bool:
    """Turn on deterministic GPU kernels for bit-exact resume; return whether anything changed.

    On CPU nothing is needed: the built-in loop is already bit-exact there, and
    turning deterministic algorithms on would change which kernels earlier
    checkpoints were trained with.
    """
    if device.type != "cuda":
        return False
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (CUBLAS_DETERMINISTIC, ":16:8"):
        if torch.cuda.is_initialized():
            raise DeviceError(
                "deterministic: true: expected CUBLAS_WORKSPACE_CONFIG=:4096:8 in the rank's "
                f"environment before CUDA starts; found "
                f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG')!r} with CUDA already initialised; "
                "fix: start ranks through Relay's node agent (it sets it), export "
                "CUBLAS_WORKSPACE_CONFIG=:4096:8 before launching, or set deterministic: false"
            )
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC  # cuBLAS not started yet
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    return True


def setup_rank_device(
    requested: str, *, local_rank: int, local_world_size: int, deterministic: bool
) -> RankDevice:
    """Resolve the backend, pick and bind the device, and set determinism: one call per rank."""
    backend = resolve_backend(requested, local_world_size)
    device = rank_device(backend, local_rank)
    exact = enable_determinism(device) if deterministic else False
    return RankDevice(backend, device, exact, ddp_kwargs(device))


def rank_environment(requested: str, attempt_dir: Path, *, deterministic: bool) -> dict[str, str]:
    """Return the environment the node agent adds for every rank (never touches CUDA).

    ``requested`` is the spec's ``auto|gloo|nccl``: the agent does not know yet
    whether a rank will find GPUs, so the NCCL settings come along unless gloo
    was forced (they are inert under gloo).
    """
    env = {
        "TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
        "TORCH_FR_DUMP_TEMP_FILE": str(Path(attempt_dir) / FLIGHT_RECORDER_DIR / "rank_"),
    }
    if requested == Backend.GLOO:
        return env
    env.update({
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
    })
    if deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC
    return env


def rank_start_method() -> str:
    """Return how the node agent may start ranks: ``fork``, or ``spawn`` once CUDA is up.

    A CUDA context does not survive ``fork`` (the child fails with "Cannot
    re-initialize CUDA in forked subprocess"), so an agent whose preloading
    touched CUDA starts fresh interpreters instead, losing the preload but not
    the job.
    """
    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: False)()
    if torch.cuda.is_initialized() or in_bad_fork:
        log.warning(
            "CUDA is initialised in the node agent (pid %d), so its ranks cannot be forked: "
            "starting them with spawn (slower start-up). Fix: keep CUDA calls out of module "
            "top level in code the agent preloads", os.getpid(),
        )
        return "spawn"
    return "fork"


def wait_for_compute(device: torch.device) -> None:
    """Block until the work queued on ``device``'s current stream has run (no-op on CPU).

    Called where a rank declares "compute done, entering the collective". CUDA
    kernels run asynchronously, so without this a rank stalled in a kernel would
    look like it waits in the collective, and the hang would be blamed on no one.
    """
    if device.type != "cuda":
        return
    torch.cuda.current_stream(device).synchronize()


def apply_thread_count() -> int:
    """Give this rank the intra-op thread count ``OMP_NUM_THREADS`` asks for; return it.

    The OpenMP runtime reads ``OMP_NUM_THREADS`` once, when it starts: for a forked rank
    that was in the node agent, before the launcher's environment reached the rank.
    And a forked process keeps the count of the thread that forked it: a rank forked
    from a standby that a resident agent forked (the resident preloads in a thread,
    and ``torch.set_num_threads`` there does not reach its main thread) ran with one
    intra-op thread per core, not the one the launcher set.
    """
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        torch.set_num_threads(int(value))
    return torch.get_num_threads()
