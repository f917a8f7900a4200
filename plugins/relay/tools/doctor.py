"""`relay doctor`: check that this machine can run Relay's ranks; say how to fix what cannot.

Each check returns a :class:`Check` (ok, warn, fail or skip, what was found, the
fix). Only ``fail`` makes the command exit non-zero: something a job needs is
broken. torch is imported inside the checks, so the CLI stays light.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

from relay.core import settings
from relay.launchers.local.ports import listen_port
from relay.tools.clock import ClockReading, db_clock, http_clock

log = logging.getLogger(__name__)

ALLREDUCE_TIMEOUT_SECONDS = 120.0  # spawning 2 interpreters that import torch; slow on a busy host


class Status(StrEnum):
    """How a check ended."""

    OK = "ok"
    WARN = "warn"  # works here, but will bite in some setups
    FAIL = "fail"  # something a job needs is broken: `relay doctor` exits 1
    SKIP = "skip"  # does not apply to this machine (e.g. NCCL without GPUs)


@dataclass(frozen=True)
class Check:
    """One finding of `relay doctor`."""

    name: str
    status: Status
    detail: str
    fix: str = ""


def nvidia_smi() -> list[tuple[str, str]] | None:
    """Return ``(name, driver version)`` per GPU from nvidia-smi, or None without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("nvidia-smi failed: %s", err)
        return []
    rows = [line.rsplit(",", 1) for line in out.splitlines() if "," in line]
    return [(name.strip(), driver.strip()) for name, driver in rows]


GpuLister = Callable[[], list[tuple[str, str]] | None]


def check_gpus(required: int, smi: GpuLister = nvidia_smi) -> Check:
    """Report the GPUs torch sees (count, names, CUDA and driver version)."""
    import torch

    seen_by_driver = smi()
    driver = seen_by_driver[0][1] if seen_by_driver else "unknown (nvidia-smi not found)"
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(count))
        detail = f"{count} GPU(s): {names}; CUDA {torch.version.cuda}; driver {driver}"
        if count < required:
            return Check("gpus", Status.FAIL, f"{detail}; expected at least {required}",
                         "run on a node with more GPUs, or lower ranks_per_node to "
                         f"{count} so each rank gets its own GPU")
        return Check("gpus", Status.OK, detail)
    if seen_by_driver:
        return Check(
            "gpus", Status.FAIL,
            f"nvidia-smi sees {len(seen_by_driver)} GPU(s) ({seen_by_driver[0][0]}, driver "
            f"{driver}) but torch {torch.__version__} cannot use them "
            f"(torch.version.cuda is {torch.version.cuda})",
            "install a CUDA build of torch that this driver supports (see "
            "https://pytorch.org/get-started/locally/), or check CUDA_VISIBLE_DEVICES",
        )
    if required > 0:
        return Check("gpus", Status.FAIL, f"no GPU seen; expected at least {required}",
                     "run on a GPU node with the NVIDIA driver installed, or drop --gpus")
    return Check("gpus", Status.SKIP, "no GPU seen: ranks use gloo on CPU (backend: auto)")


def check_nccl() -> Check:
    """Report whether NCCL is usable and its version."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return Check("nccl", Status.SKIP, "no GPU: NCCL is not needed (gloo on CPU)")
    if not dist.is_nccl_available():
        return Check("nccl", Status.FAIL, "torch.distributed has no NCCL backend in this build",
                     "install a CUDA build of torch (it ships NCCL), or set backend: gloo")
    try:
        version = ".".join(str(part) for part in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError) as err:
        return Check("nccl", Status.WARN, f"NCCL backend present, version unknown ({err})")
    return Check("nccl", Status.OK, f"NCCL {version}")


def allreduce_rank(rank: int, world: int, backend: str, init_method: str,
                   timeout_seconds: float, results: Any) -> None:  # noqa: ANN401 - a Queue
    """One rank of the test all-reduce (runs in a spawned interpreter)."""
    try:
        import torch
        import torch.distributed as dist

        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_seconds))
        value = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(value)
        results.put((rank, float(value.item()), ""))
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - reported to the parent, which explains it
        results.put((rank, None, f"{type(err).__name__}: {err}"))


def check_allreduce(backend: str, world: int = 2,
                    timeout_seconds: float = ALLREDUCE_TIMEOUT_SECONDS) -> Check:
    """Run a real ``world``-rank all-reduce over ``backend`` on this machine's loopback."""
    name = f"{backend} all-reduce"
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{listen_port()}"
    started = time.monotonic()
    procs = [context.Process(target=allreduce_rank, name=f"doctor-rank-{r}",
                             args=(r, world, backend, init_method, timeout_seconds / 2, results))
             for r in range(world)]
    for proc in procs:
        proc.start()
    answers: dict[int, tuple[float | None, str]] = {}
    deadline = started + timeout_seconds
    try:
        while len(answers) < world and time.monotonic() < deadline:
            try:
                rank, value, error = results.get(timeout=0.5)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs):
                    break
                continue
            answers[rank] = (value, error)
    finally:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()) if len(answers) == world else 0.1)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    seconds = time.monotonic() - started
    expected = float(sum(range(1, world + 1)))
    errors = [f"rank {r}: {e}" for r, (_, e) in sorted(answers.items()) if e]
    if len(answers) < world and not errors:
        errors.append(f"{world - len(answers)} rank(s) gave no answer within {seconds:.0f}s "
                      f"(exit codes {[p.exitcode for p in procs]})")
    if errors:
        return Check(name, Status.FAIL, "; ".join(errors),
                     "check that loopback TCP works and nothing blocks local ports; for NCCL, "
                     "run with NCCL_DEBUG=INFO and see the NCCL troubleshooting guide")
    values = {v for v, _ in answers.values()}
    if values != {expected}:
        return Check(name, Status.FAIL, f"expected every rank to hold {expected}, found {values}",
                     "the collective returned wrong data: reinstall torch and retry")
    return Check(name, Status.OK,
                 f"{world} ranks on 127.0.0.1 summed to {expected:g} in {seconds:.1f}s "
                 "(including start-up)")


def check_master_addr(addr: str | None = None) -> Check:
    """Check that the rendezvous host resolves (MASTER_ADDR, else this host's name)."""
    source = "MASTER_ADDR" if addr or os.environ.get("MASTER_ADDR") else "this host's name"
    host = addr or os.environ.get("MASTER_ADDR") or socket.gethostname()
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as err:
        return Check("master address", Status.FAIL, f"{source} {host!r} does not resolve: {err}",
                     "set MASTER_ADDR to a name or IP address every node can resolve and reach")
    addresses = sorted({info[4][0] for info in infos})
    return Check("master address", Status.OK, f"{source} {host!r} resolves to "
                 f"{', '.join(addresses)}")


def _interfaces() -> list[str]:
    return sorted(name for _, name in socket.if_nameindex())


def check_socket_interfaces() -> Check:
    """Check GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, or what gloo picks without them."""
    available = _interfaces()
    gloo = os.environ.get("GLOO_SOCKET_IFNAME")
    nccl = os.environ.get("NCCL_SOCKET_IFNAME")
    missing = []
    if gloo:
        missing += [f"GLOO_SOCKET_IFNAME={n}" for n in gloo.split(",") if n not in available]
    if nccl and not nccl.startswith("^"):  # "^eth" excludes; NCCL matches names by prefix
        wanted = [n.removeprefix("=") for n in nccl.split(",")]
        missing += [f"NCCL_SOCKET_IFNAME={n}" for n in wanted
                    if not any(a == n or (not nccl.startswith("=") and a.startswith(n))
                               for a in available)]
    if missing:
        return Check("socket interface", Status.FAIL,
                     f"{', '.join(missing)}: no such interface (this machine has "
                     f"{', '.join(available)})",
                     "set the variable to one of this machine's interfaces, or unset it")
    if gloo:
        return Check("socket interface", Status.OK, f"GLOO_SOCKET_IFNAME={gloo} exists")
    # Without GLOO_SOCKET_IFNAME, gloo binds to the address this host's name resolves to.
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = "127.0.0.1"
    if address.startswith("127."):
        return Check("socket interface", Status.WARN,
                     f"GLOO_SOCKET_IFNAME is unset and {host!r} resolves to {address}: gloo "
                     "binds to loopback, fine on one machine, unreachable from other nodes",
                     f"for multi-node jobs set GLOO_SOCKET_IFNAME to the interface peers reach "
                     f"(this machine has {', '.join(available)})")
    return Check("socket interface", Status.OK,
                 f"GLOO_SOCKET_IFNAME is unset; gloo binds to {address} ({host})")


def airflow_db_url() -> str:
    """Return the Airflow metadata DB's SQLAlchemy URL Relay's Airflow uses."""
    from relay.tools.airflow_env import airflow_env
    env = {**airflow_env(), **os.environ}
    configured = env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN")
    return configured or f"sqlite:///{env['AIRFLOW_HOME']}/airflow.db"


def _clock_check(name: str, read: Callable[[], ClockReading], max_skew_seconds: float) -> Check:
    try:
        reading = read()
    except Exception as err:  # noqa: BLE001 - any failure to read is reported, not raised
        return Check(name, Status.WARN, f"could not read the clock: {type(err).__name__}: {err}",
                     "check that the server is up and reachable from this machine")
    detail = f"checked {reading.source}: offset {reading.describe()}"
    if reading.skew_beyond(max_skew_seconds):
        return Check(name, Status.FAIL, f"{detail}, more than {max_skew_seconds:g}s",
                     "synchronise clocks with NTP (chrony or systemd-timesyncd) on every node "
                     "and server; timestamps in MLflow and Airflow will disagree until then")
    return Check(name, Status.OK, detail)


def check_clocks(max_skew_seconds: float, tracking_uri: str | None = None,
                 airflow_db: str | None = None) -> list[Check]:
    """Compare this machine's clock with the MLflow server's and the Airflow DB's."""
    uri = tracking_uri or settings.mlflow_tracking_uri()
    if uri.startswith(("http://", "https://")):
        health = uri.rstrip("/") + "/health"
        mlflow = _clock_check("clock vs MLflow", lambda: http_clock(health), max_skew_seconds)
    else:
        mlflow = Check("clock vs MLflow", Status.SKIP,
                       f"tracking URI {uri} is not a server: no other clock to compare")
    db = airflow_db or airflow_db_url()
    path = db.removeprefix("sqlite:///")
    if db.startswith("sqlite:///") and not os.path.exists(path):
        airflow = Check("clock vs Airflow DB", Status.SKIP, f"no Airflow DB yet at {path}")
    else:
        airflow = _clock_check("clock vs Airflow DB", lambda: db_clock(db), max_skew_seconds)
    return [mlflow, airflow]


def check_node_pool() -> Check:
    """Read the node pool where the settings keep it (``RELAY_NODE_POOL_URL`` or nodes.json)."""
    from relay.core.exceptions import PoolStoreError
    from relay.nodes.store import FileStore, from_settings

    try:
        store = from_settings()
        with store.locked() as state:
            found = f"{len(state['quarantines'])} quarantine(s), {len(state['leases'])} lease(s)"
    except PoolStoreError as err:
        return Check("node pool", Status.FAIL, str(err))
    if isinstance(store, FileStore):
        return Check("node pool", Status.OK, f"{store.describe()}: {found} (seen by this "
                     "machine only; set RELAY_NODE_POOL_URL for the Celery or Kubernetes "
                     "executor)")
    return Check("node pool", Status.OK, f"{store.describe()}: {found}")


def run_checks(*, gpus: int = 0, max_skew_seconds: float = 2.0, tracking_uri: str | None = None,
               airflow_db: str | None = None,
               allreduce: Callable[[str], Check] = check_allreduce) -> list[Check]:
    """Run every check, in the order they are printed."""
    import torch
    import torch.distributed as dist

    checks = [check_gpus(gpus), check_nccl(), allreduce("gloo")]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available():
        checks.append(allreduce("nccl"))
    else:
        checks.append(Check("nccl all-reduce", Status.SKIP, "needs 2 GPUs and NCCL"))
    checks += [check_master_addr(), check_socket_interfaces()]
    checks += check_clocks(max_skew_seconds, tracking_uri, airflow_db)
    checks.append(check_node_pool())
    return checks


def render(checks: list[Check]) -> str:
    """Return the report: one line per check, the fix indented under problems."""
    width = max(len(c.name) for c in checks)
    lines = []
    for check in checks:
        label = check.status.value.upper() if check.status is Status.FAIL else check.status.value
        lines.append(f"  {label:5} {check.name:{width}}  {check.detail}")
        if check.fix and check.status in (Status.FAIL, Status.WARN):
            lines.append(f"  {'':5} {'':{width}}  fix: {check.fix}")
    failed = sum(c.status is Status.FAIL for c in checks)
    lines.append(f"relay doctor: {failed} problem(s) found" if failed else
                 "relay doctor: nothing needed is broken")
    return "\n".join(lines)


def main(*, gpus: int = 0, max_skew_seconds: float = 2.0) -> int:
    """Run `relay doctor`; return 1 if something needed is broken."""
    import torch

    print(f"relay doctor: {socket.gethostname()}, torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}", flush=True)
    checks = run_checks(gpus=gpus, max_skew_seconds=max_skew_seconds)
    print(render(checks))
    return 1 if any(c.status is Status.FAIL for c in checks) else 0
