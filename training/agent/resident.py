"""Resident agents: a preloaded process on a node, from which standbys fork.

A retry that moves off a faulty node runs on a node the job did not use, and the
standby Relay starts there (:mod:`relay_train.agent.standby`) is a new interpreter that
imports the training stack (seconds of CPU, beside the running ranks) while the
rest of the retry waits for it. A resident agent takes that off the recovery's
path: started with the DAG run, it preloads once, yielding the CPU to the ranks
(see :mod:`relay_train.agent.priority`: its session's weight is the lowest Linux gives
until it is preloaded or asked for a standby), and then waits. Asked for a standby, it forks
one: a copy that is preloaded already, ready at once, exactly like a copy of a
running node's agent. On a cluster this is a node-resident daemon. Relay's local
launcher, whose simulated nodes all share one host, runs one per DAG run,
started by preflight, and the ask names the node the standby is for: it forks
the first segment's standbys as well as every retry's, so the run imports the
stack once (a standby or resident of its own per node imports it again, on the
CPUs the ranks train on: about 4 CPU-seconds each on a 2-core machine).

The handshake, in the DAG run's ``resident`` folder, ``<node>`` being the node:

- ``<node>.standby``: written by the launcher when it starts the resident (pid),
  so that :meth:`release_standbys` stops it like any untaken standby;
- ``<node>.ready``: written by the resident once preloaded;
- ``<node>.asks/<id>.ask``: a request (standby folder, ttl, linger, and the node
  the standby is for: ``<node>`` itself unless the ask names another). The resident
  takes it by renaming it to ``<id>.taken`` and answers ``<id>.pid`` once forked;
  an asker that gives up withdraws it by renaming it to ``<id>.withdrawn``: the
  rename is atomic, so an ask is either forked or withdrawn, never both. An ask
  taken as its asker gives up is waited for until its PID comes (a resident killed
  between the two is given up on after ``TAKEN_WAIT_SECONDS``).

A resident leaves when its run is over: stopped by the run's end (or ``make
down``), or by itself once its run's orchestrator lease has lapsed
(:mod:`relay_train.protocol.run_lease`: its Airflow task and triggerer were killed, or
a newer run took over and no one renews this one) or, in a run folder with no lease,
once no rank of its run has written a heartbeat for ``idle_seconds``.

A resident can also be started before its DAG run exists (prestarted: Relay's own
``airflow dags test`` runner starts it beside Airflow's start-up, see
:mod:`relay.launchers.local.prestart`), in a folder of its own. Preflight takes it
by creating ``run`` there (:func:`take_resident`: the DAG run's folder, created
exclusively: one run only) and links the run's ``resident`` folder to it. Until
then it has no run whose heartbeats it could watch; untaken after
``take_within`` seconds, it marks itself taken (so that no run takes it as
it leaves) and leaves.

The asking side is stdlib only: the launcher imports it without torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from relay_train.agent.priority import restore_session, yield_session, yielding_thread
from relay_train.protocol import run_lease
from relay_train.protocol.heartbeat import write_atomically

log = logging.getLogger("relay_train.agent.resident")

RESIDENT_DIR = "resident"  # in a DAG run's folder
IDLE_SECONDS = 600.0  # no heartbeat of the run this long: the run is over, leave
IDLE_CHECK_SECONDS = 5.0  # how often the resident looks at its run's heartbeats
ASK_WAIT_SECONDS = 1.0  # a ready resident forks within its poll; longer means it is stuck
TAKEN_WAIT_SECONDS = 15.0  # a taken ask is answered once forked (fork_detached: 10 s at most)
POLL_SECONDS = 0.05
TAKEN_BY_FILE = "run"  # in a prestarted resident's folder: the DAG run folder that taken it
NOT_TAKEN = ""  # what ``run`` holds when no run took it in time (or it was released)


def take_resident(directory: Path, owner: str) -> bool:
    """Create a prestarted resident's ``run`` file naming ``owner``, whole, unless it
    exists; return whether this call created it (exactly one caller ever does)."""
    staged = directory / f"{TAKEN_BY_FILE}.{uuid.uuid4().hex}"
    try:
        staged.write_text(owner)
        os.link(staged, directory / TAKEN_BY_FILE)  # fails if it exists: exclusive
    except FileExistsError:
        return False
    finally:
        staged.unlink(missing_ok=True)
    return True


def ready_file(directory: Path, node: str) -> Path:
    """Return the file a resident writes once preloaded."""
    return directory / f"{node}.ready"


def asks_dir(directory: Path, node: str) -> Path:
    """Return the folder of the requests to ``node``'s resident."""
    return directory / f"{node}.asks"


def ask_standby(directory: Path, node: str, standby_dir: Path, ttl: float, linger: float,
                wait_seconds: float = ASK_WAIT_SECONDS, preloading_wait_seconds: float = 0.0,
                for_node: str | None = None) -> int | None:
    """Ask ``node``'s resident to fork a standby into ``standby_dir`` for ``for_node``
    (default ``node``, the resident's own); return its PID.

    A resident still preloading is asked too when ``preloading_wait_seconds`` is set
    (it stops yielding the CPU and answers once preloaded, which is sooner than a new
    process could preload the same stack beside it). None when it did not answer in
    time (or was not ready and is not waited for): the caller starts a standby the
    slow way.
    """
    if not ready_file(directory, node).exists():
        if preloading_wait_seconds <= 0:
            return None
        wait_seconds = max(wait_seconds, preloading_wait_seconds)
    asks = asks_dir(directory, node)
    asks.mkdir(exist_ok=True)
    name = uuid.uuid4().hex
    ask = asks / f"{name}.ask"
    write_atomically(ask, json.dumps({"directory": str(standby_dir), "ttl": ttl,
                                      "linger": linger, "node": for_node or node}))
    reply = asks / f"{name}.pid"
    if not _wait_for(reply, wait_seconds):
        try:
            os.rename(ask, asks / f"{name}.withdrawn")
        except FileNotFoundError:  # taken this instant: it forks now, wait for the PID
            if not _wait_for(reply, TAKEN_WAIT_SECONDS):
                log.warning("the resident on %s took a standby ask and gave no PID in %.0f s;"
                            " starting the standby the slow way", node, TAKEN_WAIT_SECONDS)
                (asks / f"{name}.taken").unlink(missing_ok=True)
                return None
        else:
            (asks / f"{name}.withdrawn").unlink(missing_ok=True)
            return None
    try:
        pid = json.loads(reply.read_text())["pid"]
    except (OSError, ValueError, KeyError, TypeError):
        pid = None
    for f in (reply, asks / f"{name}.taken"):
        f.unlink(missing_ok=True)
    return pid if isinstance(pid, int) and pid > 0 else None


def _wait_for(path: Path, seconds: float) -> bool:
    """Return whether ``path`` exists within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


class Resident:
    """The node side: preload, then fork a standby for each request."""

    def __init__(self, directory: Path, node: str, idle_seconds: float = IDLE_SECONDS,
                 take_within: float | None = None) -> None:
        self.directory = directory
        self.node = node
        self.idle_seconds = idle_seconds
        self.take_within = take_within  # prestarted: leave unless a run takes it by then
        self.stopping = False

    def preload(self) -> float:
        """Import the training stack while yielding the CPU to the ranks of the node's
        other sessions, until asked for a standby; return the seconds it took.

        The session gets its weight back once preloaded: waiting costs no CPU, and a
        resident left at the lowest weight answers an ask only when the busy ranks let
        it run (1.0-1.2 s to fork a retry's standby, in a run under the real scheduler,
        where the first segment's ask came after the preload)."""
        started = time.perf_counter()
        yielded = yield_session()  # before torch's import; its standbys start anew (setsid)
        thread = yielding_thread(_preload_stack, "preload")  # where sessions do not count
        checked = time.monotonic()
        while thread.is_alive():  # no thread is left when the main thread forks
            thread.join(POLL_SECONDS)
            if time.monotonic() - checked > IDLE_CHECK_SECONDS:  # at the lowest weight on a
                checked = time.monotonic()  # loaded host, a preload takes minutes
                if self._lease_lapsed():
                    self.stopping = True  # run() leaves; the import thread dies with it
                    break
            if yielded is not None and any(asks_dir(self.directory, self.node).glob("*.ask")):
                log.info("resident on %s: asked for a standby while preloading; no longer "
                         "yielding the CPU", self.node)
                restore_session(yielded)
                yielded = None
        if yielded is not None:
            restore_session(yielded)
        return time.perf_counter() - started

    def run(self) -> int:
        """Preload, announce, then answer requests until stopped or idle."""
        preloaded = self.preload()  # SIGTERM meanwhile ends it at once (its default)
        if self.stopping:
            return 0
        signal.signal(signal.SIGTERM, self._on_term)
        write_atomically(ready_file(self.directory, self.node), json.dumps(
            {"pid": os.getpid(), "ready_at": time.time(), "preload_seconds": preloaded}))
        log.info("resident on %s: preloaded in %.2fs; waiting for requests", self.node,
                 preloaded)
        checked = last_active = time.monotonic()
        take_by = None if self.take_within is None else checked + self.take_within
        while not self.stopping:
            if self._answer():
                last_active = time.monotonic()
            _reap()
            now = time.monotonic()
            if take_by is not None and now > take_by:
                if take_resident(self.directory, NOT_TAKEN):
                    log.info("resident on %s: no DAG run took it within %.0fs; leaving",
                             self.node, self.take_within)
                    break
                take_by = None  # a run took it: its heartbeats decide now
            if now - checked > IDLE_CHECK_SECONDS:
                checked = now
                if self._lease_lapsed():
                    break
                last_active = max(last_active, now - self._heartbeat_age())
                if now - last_active > self.idle_seconds:
                    log.info("resident on %s: its run is over (no heartbeat for %.0fs); "
                             "leaving", self.node, self.idle_seconds)
                    break
            time.sleep(POLL_SECONDS)
        ready_file(self.directory, self.node).unlink(missing_ok=True)
        return 0

    def _answer(self) -> bool:
        """Fork a standby for each request waiting; return whether there was one."""
        asks = sorted(asks_dir(self.directory, self.node).glob("*.ask"))
        for ask in asks:
            taken = ask.with_suffix(".taken")
            try:
                os.rename(ask, taken)
            except FileNotFoundError:
                continue  # withdrawn
            try:
                request = json.loads(taken.read_text())
                pid = self._fork(str(request.get("node", self.node)),
                                 Path(request["directory"]), float(request["ttl"]),
                                 float(request["linger"]))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("resident on %s: bad request %s (%s)", self.node, taken, exc)
                pid = -1
            write_atomically(ask.with_suffix(".pid"), json.dumps({"pid": pid}))
        return bool(asks)

    def _fork(self, node: str, directory: Path, ttl: float, linger: float) -> int:
        from relay_train.agent.node import fork_standby

        pid = fork_standby(node, directory, ttl, linger)
        log.info("resident on %s: forked a standby for %s, pid %d, into %s", self.node,
                 node, pid, directory)
        return pid

    def _run_dir(self) -> Path | None:
        """Return the DAG run's folder: the one that took a prestarted resident (None
        while none did), else the folder this one was started in."""
        if self.take_within is None:
            return self.directory.parent
        try:
            owner = (self.directory / TAKEN_BY_FILE).read_text().strip()
        except OSError:
            return None
        return Path(owner) if owner else None

    def _lease_lapsed(self) -> bool:
        """Return whether no one renewed the run's orchestrator lease in time (and say so)."""
        run_dir = self._run_dir()
        if run_dir is None or not run_lease.lapsed(run_dir):
            return False
        log.info("resident on %s: no one renewed its run's orchestrator lease (%s); leaving",
                 self.node, run_dir / run_lease.LEASE_FILE)
        return True

    def _heartbeat_age(self) -> float:
        """Return the seconds since any rank of this run wrote a heartbeat (inf: none yet)."""
        newest = 0.0
        run_dir = self._run_dir()
        beats = run_dir.glob("segment-*/try-*/heartbeats/*.json") if run_dir else ()
        for beat in beats:
            try:
                newest = max(newest, beat.stat().st_mtime)
            except OSError:
                continue
        return time.time() - newest if newest else float("inf")

    def _on_term(self, _signum: int, _frame: object) -> None:
        self.stopping = True


def _preload_stack() -> None:
    from relay_train.agent.preload import preload_worker
    from relay_train.protocol.launch import BUILTIN_ENTRYPOINT, Entrypoint

    preload_worker(Entrypoint(BUILTIN_ENTRYPOINT), publisher=True)


def _reap() -> None:
    """Collect the standbys that ended (they left this session, not this parentage)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m relay_train.agent.resident --dir DIR --node NODE``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, required=True, help="the DAG run's resident folder")
    parser.add_argument("--node", required=True)
    parser.add_argument("--idle", type=float, default=IDLE_SECONDS,
                        help="leave once no rank of the run wrote a heartbeat this long")
    parser.add_argument("--take-within", type=float, default=None,
                        help="prestarted (no DAG run yet): leave unless one takes it this soon")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s resident {args.node} %(levelname)s: %(message)s")
    return Resident(args.dir, args.node, args.idle, args.take_within).run()


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    os._exit(code)
