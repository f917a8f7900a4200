"""A node's agent: start the node's ranks, report their liveness, stop them on demand.

One agent per (simulated) node, started by a launcher in its own session and
process group, so that it outlives the Airflow task that started it (the task
defers) and can be stopped as a group. It answers Relay over the network
(:mod:`relay_train.agent.server`): its state, every rank's exit code and log tail,
the ranks' heartbeats with their ages on this node's clock, and Relay's
requests (stop, drain, rescue, stacks). Once its ranks have ended it keeps
answering for ``--linger`` seconds, until Relay stops it, so the final state
is read over the channel too. A SIGTERM Relay did not ask for is the platform's
preemption notice (:mod:`relay_train.agent.notice`): the ranks train on, the channel
says ``preempted``, and Relay drains them within the grace.

The agent is a fork server: it imports what every rank needs once (torch,
the training loop, the optimizer's lazy imports, MLflow on the node hosting
rank 0) and then forks its ranks (:mod:`relay_train.agent.ranks`: their
environment, logs and stop), so they skip those seconds of start-up. A resume
pays for them once per node, not once per rank, which on a loaded host is most
of the time from launch to the first productive step. Asked over the channel,
it forks a preloaded copy of itself as the node's standby for the next attempt
(:mod:`relay_train.agent.standby_fork`).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import time
from pathlib import Path
from typing import Any

from relay_train.agent.node_status import NodeStatus
from relay_train.agent.notice import Notice, grace_from_env, notice_of_sigterm
from relay_train.agent.preload import preload_worker
from relay_train.agent.ranks import (
    RankProcess,
    exec_rank,
    rank_env,
    rank_log,
    ship_logs,
    start_rank,
    stop_ranks,
)
from relay_train.agent.server import AgentServer
from relay_train.agent.standby import (
    announce_ready,
    fork_detached,
    wait_for_launch,
)
from relay_train.agent.standby_fork import (
    StandbyAsk,
    agent_log_format,
    leave_attempt,
    redirect_output,
)
from relay_train.device import (
    FLIGHT_RECORDER_DIR,
    rank_environment,
    rank_start_method,
)
from relay_train.protocol import run_lease
from relay_train.protocol.channel_tls import server_context_from_env
from relay_train.protocol.env import ENV_CHANNEL_SECRET, ENV_NODE
from relay_train.protocol.launch import (
    BUILTIN_ENTRYPOINT,
    PREEMPTED_EXIT,
    Entrypoint,
    LaunchConfig,
)
from relay_train.protocol.routes import (
    STANDBY_TTL_SECONDS,
    NodeState,
)

log = logging.getLogger("relay_train.agent.node")

LOCAL_BIND = "127.0.0.1"
STANDBY_FORK_WAIT_SECONDS = 1.0  # the channel's wait for the main thread to fork a standby


class NodeAgent(NodeStatus):
    """Supervise the ranks of one node."""

    def __init__(
        self, cfg: LaunchConfig, launch_file: Path, node: str, *, preloaded: bool = False,
        bind: str = LOCAL_BIND, port: int | None = None, linger_seconds: float = 0.0,
        secret: str | None = None,
    ) -> None:
        self.secret = secret or cfg.channel_secret  # the channel's (see run)
        self.cfg = cfg
        self.preloaded = preloaded
        self.node = node
        self.launch_file = launch_file
        self.attempt_id = cfg.fence_id
        self.root = cfg.root
        self.ranks = [cfg.global_rank(node, r) for r in range(cfg.ranks_per_node)]
        self.procs: dict[int, RankProcess] = {}
        self.stopping = False
        self.state = NodeState.STARTING
        self.linger_seconds = linger_seconds
        self._error_tails: dict[int, str] = {}
        self._first: dict[str, Any] | None = None
        self._chaos: tuple[int, list[dict[str, Any]]] = (0, [])
        self._address = (bind, cfg.agent_ports.get(node, 0) if port is None else port)
        self.server: AgentServer | None = None
        self._standby_asks: queue.SimpleQueue[StandbyAsk] = queue.SimpleQueue()
        self.grace_seconds = grace_from_env()  # a preemption notice's (see _on_term)
        self.notice: Notice | None = None

    def preload(self) -> float:
        """Import what the ranks need, once, before forking them; return the seconds it took
        (none when the ranks run the spec's own interpreter: they are not forks)."""
        started = time.perf_counter()
        if self.cfg.entrypoint.python is not None:
            return 0.0
        # MLflow on every node, before the ranks: rank 0's node publishes checkpoints, every
        # node of a resumed attempt fetches its resume checkpoint, and a copy of any agent
        # (its standby for a retry) must be ready to. Imported later, beside running ranks,
        # it held the GIL for seconds at a time while the channel's thread waited: the node
        # looked silent (see docs/benchmarks.md, "detect --load").
        preload_worker(self.cfg.entrypoint, publisher=True, tracking_uri=self.cfg.tracking_uri)
        return time.perf_counter() - started

    def start_ranks(self) -> None:
        """Fork one worker process per local rank (spawn if preloading touched CUDA; the
        spec's ``entrypoint.python``: start each with that interpreter)."""
        self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
        (self.cfg.root / FLIGHT_RECORDER_DIR).mkdir(parents=True, exist_ok=True)
        context = multiprocessing.get_context(rank_start_method())
        device_env = rank_environment(
            self.cfg.backend, self.cfg.root, deterministic=self.cfg.deterministic
        )
        for local_rank in range(self.cfg.ranks_per_node):
            rank = self.cfg.global_rank(self.node, local_rank)
            env = rank_env(self.cfg, self.node, local_rank, device_env)
            log_file, name = rank_log(self.cfg, rank), f"rank-{rank}"
            if self.cfg.entrypoint.python is None:
                proc: RankProcess = start_rank(context, env, log_file, self.launch_file, name)
            else:  # the spec's interpreter: started afresh, not forked
                proc = exec_rank(self.cfg, env, log_file, self.launch_file, name)
            self.procs[rank] = proc
            log.info("started rank %d as pid %d", rank, proc.pid)

    def set_state(self, state: NodeState) -> None:
        """Change this node's state, as the channel reports it."""
        self.state = state

    def request_stop(self, reason: str) -> None:
        """Stop the ranks and end (Relay's stop over the channel, or SIGTERM)."""
        if not self.stopping:
            log.warning("stop requested: %s", reason)
        self.stopping = True

    def request_standby(self, directory: Path, ttl: float, linger: float) -> int | None:
        """Fork a standby for this node's next attempt; return its PID (None: not now).

        Called from the channel's thread; the main thread forks (it holds no lock
        between its polls), within ``STANDBY_FORK_WAIT_SECONDS``. The standby is this
        agent's copy: preloaded already, so it is ready at once instead of importing
        the training stack again while Relay winds down the faulty attempt.
        """
        if self.stopping:
            return None
        ask = StandbyAsk(directory, ttl, linger)
        self._standby_asks.put(ask)
        if not ask.done.wait(STANDBY_FORK_WAIT_SECONDS):
            with ask.lock:  # too late: never fork a standby nobody recorded
                if ask.state == "asked":
                    ask.state = "withdrawn"
                    return None
            ask.done.wait()  # forking now: a fork returns at once
        return ask.pid

    def _fork_standbys(self) -> None:
        """Answer the standby requests waiting (main thread only)."""
        while True:
            try:
                ask = self._standby_asks.get_nowait()
            except queue.Empty:
                return
            with ask.lock:
                go = ask.state == "asked" and not self.stopping
                ask.state = "forking" if go else "withdrawn"
            if go:
                ask.pid = self._fork_standby(ask)
            ask.done.set()

    def _fork_standby(self, ask: StandbyAsk) -> int:
        """Fork a standby for this node's next attempt; return its PID."""
        pid = fork_standby(self.node, ask.directory, ask.ttl, ask.linger)
        log.info("forked a standby for %s's next attempt as pid %d in %s", self.node, pid,
                 ask.directory)
        return pid

    def stop_ranks(self, reason: str) -> None:
        """Terminate the ranks still running: SIGTERM, then SIGKILL after a grace period."""
        stop_ranks([p for p in self.procs.values() if p.exitcode is None], reason)

    def run(self) -> int:
        """Supervise until every rank has exited; return 0 only if all succeeded (2: no
        channel secret, nothing started)."""
        if not self.secret:
            log.error("node %s: expected the attempt's channel secret in %s (field "
                      "channel_secret) or in $%s, found neither; launch the attempt with a "
                      "Relay that makes one (an agent answers nobody without it)", self.node,
                      self.launch_file, ENV_CHANNEL_SECRET)
            return 2
        signal.signal(signal.SIGTERM, self._on_term)
        try:
            code = self._supervise()
            ship_logs(self.cfg, self.node)
            self._linger()
        finally:
            if self.server is not None:
                self.server.close()
        return PREEMPTED_EXIT if self.notice is not None else code

    def _serve(self) -> None:
        """Open the channel: after the ranks are forked, so none holds its socket or a lock."""
        self.server = AgentServer(self, *self._address, secret=self.secret).start()

    def _supervise(self) -> int:
        if not self.preloaded:
            log.info("preloaded the training stack in %.2fs", self.preload())
        else:  # a standby preloaded already: this imports nothing new
            self.preload()
        if self.stopping or self.notice is not None:  # nothing trains yet: nothing to drain
            self.set_state(NodeState.FAILED)
            self._serve()  # to say so
            return 1
        self.start_ranks()
        self.set_state(NodeState.RUNNING)
        try:
            self._serve()
        except OSError as exc:  # the port is taken: Relay could never reach this node
            log.error("channel: cannot listen on %s:%d (%s); stopping the ranks", *self._address,
                      exc)
            self.stop_ranks("the agent cannot be reached")
            self.set_state(NodeState.FAILED)
            return 1
        while True:
            codes = {r: p.exitcode for r, p in self.procs.items()}
            if self.notice is not None and not self.stopping and self.notice.due():
                self.stopping = True  # no stop from Relay in time: beat the platform's SIGKILL
            if self.stopping:
                self.stop_ranks("agent asked to stop")
            elif any(c not in (None, 0) for c in codes.values()):
                failed = {r: c for r, c in codes.items() if c not in (None, 0)}
                self.stop_ranks(f"rank(s) failed with exit codes {failed}")
            running = [p.sentinel for p in self.procs.values() if p.exitcode is None]
            if not running:
                break
            self._fork_standbys()
            # Up to 0.1 s, as before, for a stop or a standby ask; a rank's exit ends it at
            # once (the run's end and a crash are reported that much sooner).
            multiprocessing.connection.wait(running, timeout=0.1)
        ok = all(p.exitcode == 0 for p in self.procs.values())
        self.set_state(NodeState.SUCCEEDED if ok else NodeState.FAILED)
        log.info("all ranks exited: %s", {r: p.exitcode for r, p in self.procs.items()})
        return 0 if ok else 1

    def _linger(self) -> None:
        """Keep answering (the final state) until Relay stops us or ``linger_seconds`` pass."""
        deadline = time.monotonic() + self.linger_seconds
        while not self.stopping and time.monotonic() < deadline and not (
                self.notice is not None and self.notice.expired()):
            self._fork_standbys()
            time.sleep(0.1)
            # (the lease is read during one second in five: a run nobody orchestrates)
            if int(deadline - time.monotonic()) % 5 == 0 and run_lease.attempt_lapsed(self.root):
                log.info("the run's orchestrator lease lapsed: no one will ask; leaving")
                return

    def _on_term(self, _signum: int, _frame: object) -> None:
        """Take a SIGTERM as the platform's preemption notice unless it is Relay's stop (asked
        over the channel, or marked in the attempt folder) or a notice came already."""
        if not self.stopping and self.notice is None:
            self.notice = notice_of_sigterm(self.root, self.grace_seconds)  # logged by _supervise
            self.stopping = self.notice is None


def fork_standby(node: str, directory: Path, ttl: float, linger: float) -> int:
    """Fork a copy of this preloaded process (an agent or a resident) that leaves its
    attempt and waits in ``directory`` as ``node``'s standby; return its PID (the
    child never returns)."""
    pid = fork_detached()
    if pid:
        return pid
    code = 1
    try:
        leave_attempt(node, directory)
        code = run_standby(directory, node, ttl, linger)
    except BaseException:  # noqa: BLE001 - the child must never return into its parent
        logging.exception("standby forked for %s failed", node)
    finally:
        os._exit(code)


def run_standby(directory: Path, node: str, ttl_seconds: float,
                linger_seconds: float = 0.0) -> int:
    """Preload, wait to be claimed (see relay_train.agent.standby), then run as the node's agent."""
    started = time.perf_counter()
    # The entrypoint is not known yet: preload the example's.
    preload_worker(Entrypoint(BUILTIN_ENTRYPOINT), publisher=True)
    preloaded = time.perf_counter() - started
    announce_ready(directory, node, preloaded)
    log.info("standby for %s: preloaded in %.2fs; waiting to be claimed", node, preloaded)
    launch = wait_for_launch(directory, node, ttl_seconds)
    if launch is None:
        log.info("standby for %s: released or unclaimed; leaving", node)
        return 0
    cfg = LaunchConfig.read(launch)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    redirect_output(cfg.log_dir / f"agent-{node}.log")
    if node not in cfg.nodes:
        log.error("node %s: expected one of %s in %s", node, cfg.nodes, launch)
        return 2
    log.info("took over as %s's agent, preloaded in advance (%.2fs)", node, preloaded)
    return NodeAgent(cfg, launch, node, preloaded=True, linger_seconds=linger_seconds).run()


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m relay_train.agent.node (--launch F | --standby D) --node N``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--launch", type=Path, help="the attempt's launch file")
    parser.add_argument("--standby", type=Path,
                        help="preload, then wait in this folder for a launcher to claim it")
    parser.add_argument("--ttl", type=float, default=STANDBY_TTL_SECONDS,
                        help="a standby nobody claims within this many seconds leaves")
    parser.add_argument("--bind", default=LOCAL_BIND,
                        help="the address the channel listens on (a pod: 0.0.0.0)")
    parser.add_argument("--port", type=int, default=None,
                        help="the channel's port (default: the launch file's agent_ports)")
    parser.add_argument("--linger", type=float, default=0.0,
                        help="after the ranks end, keep answering this long unless stopped")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--node")
    which.add_argument("--node-index", type=int,
                       help="this node's index in the launch file's nodes (on Kubernetes: the "
                       "Indexed Job's completion index)")
    args = parser.parse_args(argv)
    if args.node is None:
        nodes = LaunchConfig.read(args.launch).nodes if args.launch else []
        if not 0 <= args.node_index < len(nodes):
            parser.error(f"--node-index: expected 0..{len(nodes) - 1} with --launch FILE, "
                         f"found {args.node_index}")
        args.node = nodes[args.node_index]
    os.environ[ENV_NODE] = args.node  # this node's clock (the skew test hook names nodes)
    # The channel secret, if the platform gave it here: read once, kept from the ranks and
    # from any standby this agent forks (a standby takes its next attempt's from its launch file).
    secret = os.environ.pop(ENV_CHANNEL_SECRET, "") or None
    logging.basicConfig(
        level=logging.INFO,
        format=agent_log_format(args.node),
        stream=sys.stderr,
    )
    try:
        server_context_from_env()  # an agent told to serve TLS without its cert/key never starts
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    if args.standby is not None:
        return run_standby(args.standby, args.node, args.ttl, args.linger)
    if args.launch is None:
        parser.error("expected --launch FILE or --standby DIR")
    cfg = LaunchConfig.read(args.launch)
    if args.node not in cfg.nodes:
        log.error("node %s: expected one of %s in %s", args.node, cfg.nodes, args.launch)
        return 2
    return NodeAgent(cfg, args.launch, args.node, bind=args.bind, port=args.port,
                     linger_seconds=args.linger, secret=secret).run()


if __name__ == "__main__":
    code = main()
    # Leave at once: the ranks are reaped and nothing is left to flush but the log; the
    # interpreter's teardown of torch and MLflow takes seconds on a loaded host, which a
    # stop would otherwise wait for (and then SIGKILL).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
