"""A node agent's ranks as processes: how each starts, what its log says, how they stop.

The agent (:mod:`relay_train.agent.node`) forks one process per local rank from its
preloaded interpreter; the child takes the rank's environment (torchrun's and Relay's),
its own log file and the default SIGTERM (SIGTERM ignored and SIGUSR1 its end when the
platform signals ranks too: ``$RELAY_SHIELD_RANKS``), then runs :func:`relay_train.worker.run_rank`.
A failed rank's own error is the end of its log, which the agent reports to Relay.
A spec's ``entrypoint.python`` makes the agent start each rank with that interpreter
instead (:class:`ExecRank`: ``python -m relay_train.agent.ranks LOG LAUNCH``, see
:mod:`relay_train.protocol.interpreter`), unpreloaded.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path

from relay_train.device import apply_thread_count
from relay_train.protocol import pids
from relay_train.protocol.env import (
    ENV_HEARTBEAT_DIR,
    ENV_HEARTBEAT_INTERVAL,
    ENV_LAUNCH,
    ENV_NODE,
    ENV_SHIELD_RANKS,
    ENV_SPAWNED_AT,
)
from relay_train.protocol.interpreter import RANK_MODULE, interpreter_env, worker_path
from relay_train.protocol.launch import LaunchConfig

log = logging.getLogger("relay_train.agent.ranks")

TERM_GRACE_SECONDS = 5.0  # from SIGTERM (or SIGUSR1, shielded) to SIGKILL


def end_signal() -> signal.Signals:
    """Return the signal that ends a rank: SIGTERM, or SIGUSR1 when the ranks are shielded
    from the platform's SIGTERM (``$RELAY_SHIELD_RANKS``: Slurm signals the whole step, and
    only the agent may take it as a notice)."""
    return signal.SIGUSR1 if os.environ.get(ENV_SHIELD_RANKS) == "1" else signal.SIGTERM


def rank_log(cfg: LaunchConfig, rank: int) -> Path:
    """Return the log file of global ``rank``."""
    return cfg.log_dir / f"rank-{rank}.log"


def rank_env(cfg: LaunchConfig, node: str, local_rank: int,
             device_env: dict[str, str]) -> dict[str, str]:
    """Return what one rank's environment gets: torchrun's, Relay's, the device's."""
    return {
        **cfg.rank_environment(node, local_rank),
        ENV_SPAWNED_AT: repr(time.time()),
        ENV_NODE: node,
        ENV_HEARTBEAT_DIR: str(cfg.heartbeat_dir),
        ENV_HEARTBEAT_INTERVAL: str(cfg.heartbeat_interval_seconds),
        **device_env,
    }


def start_rank(context: BaseContext, env: dict[str, str], log_file: Path, launch_file: Path,
               name: str) -> BaseProcess:
    """Fork (or spawn) one rank; return its process, started."""
    sys.stdout.flush()  # else the child writes the agent's buffered output again
    sys.stderr.flush()
    proc = context.Process(  # type: ignore[attr-defined]
        target=become_rank, args=(env, log_file, launch_file), name=name)
    proc.start()
    return proc


class ExecRank:
    """A rank started as its own interpreter, with what the agent uses of a forked one's
    :class:`multiprocessing.process.BaseProcess`: pid, exitcode, sentinel, terminate, kill,
    join."""

    def __init__(self, popen: subprocess.Popen[bytes], name: str) -> None:
        self._popen = popen
        self.name = name
        self.pid = popen.pid
        self.sentinel = os.pidfd_open(popen.pid)  # readable once it exits
        self._sentinel_open = True

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit code, or minus the signal that ended it."""
        code = self._popen.poll()
        if code is not None and self._sentinel_open:
            self._sentinel_open = False
            os.close(self.sentinel)
        return code

    def is_alive(self) -> bool:
        """Return whether it still runs."""
        return self.exitcode is None

    def terminate(self) -> None:
        """Send SIGTERM (nothing if it has exited)."""
        if self.exitcode is None:
            self._popen.terminate()

    def kill(self) -> None:
        """Send SIGKILL (nothing if it has exited)."""
        if self.exitcode is None:
            self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (None: for ever) for it to exit."""
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return


RankProcess = BaseProcess | ExecRank


def exec_rank(cfg: LaunchConfig, env: dict[str, str], log_file: Path, launch_file: Path,
              name: str) -> ExecRank:
    """Start one rank with the spec's interpreter (``cfg.entrypoint.python``); return it."""
    python = str(cfg.entrypoint.python)
    environ = interpreter_env({**os.environ, **env, ENV_LAUNCH: str(launch_file)},
                              worker_path(cfg.root))
    with log_file.open("ab") as log_out:
        popen = subprocess.Popen(  # noqa: S603 - the spec's interpreter, on purpose
            [python, "-m", RANK_MODULE, str(log_file), str(launch_file)],
            env=environ, stdin=subprocess.DEVNULL, stdout=log_out, stderr=subprocess.STDOUT)
    return ExecRank(popen, name)


def take_rank_signals() -> None:
    """Make :func:`end_signal` end this process; a shielded rank ignores SIGTERM (the
    platform's, for its agent to take as a notice)."""
    ending = end_signal()
    if ending != signal.SIGTERM:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(ending, signal.SIG_DFL)


def become_rank(env: dict[str, str], log_file: Path, launch_file: Path) -> None:
    """The forked child: become one rank (its own log, environment and signals)."""
    os.environ.update(env)
    take_rank_signals()
    # relay_train.init() reads the file the agent was given: on Kubernetes the ConfigMap's,
    # not the attempt folder's (which no one writes in a pod).
    os.environ[ENV_LAUNCH] = str(launch_file)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    apply_thread_count()
    from relay_train import worker

    try:
        code = worker.run_rank(launch_file)
    except BaseException:  # noqa: BLE001 - a rank's death must reach its log and exit code
        traceback.print_exc()
        code = 1
    worker.exit_now(code)


def log_tail(path: Path, lines: int = 12, max_chars: int = 4000) -> str:
    """Return the last ``lines`` lines of a log file (empty if there is none)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])[-max_chars:]


def stop_ranks(running: list[RankProcess], reason: str,
               grace_seconds: float = TERM_GRACE_SECONDS) -> None:
    """Terminate ``running``: SIGTERM (:func:`end_signal`), then SIGKILL to any still alive
    after the grace."""
    if not running:
        return
    log.warning("stopping %d rank(s): %s", len(running), reason)
    ending = end_signal()
    for proc in running:
        if ending == signal.SIGTERM:
            proc.terminate()
        elif proc.pid is not None and proc.exitcode is None:  # not reaped: still its PID
            pids.signal_process(proc.pid, pids.start_time(proc.pid), ending)
    deadline = time.monotonic() + grace_seconds
    for proc in running:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            proc.join()


def ship_logs(cfg: LaunchConfig, node: str) -> None:
    """Log this node's rank logs to the attempt's MLflow run (``logs/<node>/``), when the
    launch asks for it: on a pod or a host of its own they would die with its disk."""
    if not cfg.logs_to_mlflow or not cfg.log_dir.is_dir():
        return
    from mlflow.tracking import MlflowClient

    from relay_train.checkpoints.publish import metrics_retrying

    try:
        metrics_retrying()(MlflowClient(cfg.tracking_uri).log_artifacts, cfg.run_id,
                           str(cfg.log_dir), f"logs/{node}")
        log.info("rank logs of %s logged to MLflow run %s (logs/%s)", node, cfg.run_id, node)
    except Exception as exc:  # noqa: BLE001 - the logs are a report; the outcome stands
        log.warning("rank logs of %s not logged to MLflow run %s: %s", node, cfg.run_id, exc)


if __name__ == "__main__":  # a rank started with the spec's interpreter (exec_rank)
    if sys.path and sys.path[0] == os.getcwd():
        del sys.path[0]  # `-m` put the agent's working directory there; a forked rank has none
    become_rank({}, Path(sys.argv[1]), Path(sys.argv[2]))
