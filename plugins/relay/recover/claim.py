"""Who acts on an attempt's fault: the segment task or its warden, exactly one of them.

Two kinds of actor may act on a detected fault: ``execute_complete`` (the
segment task, through :func:`relay.recover.pipeline.handle`) and the attempt's
warden (:mod:`relay.recover.warden`), which acts only when no one took the fault
within ``detection.stop_unattended_after``. With Celery or Kubernetes executors
they may run on different machines (Airflow may even run a watcher, and so
start a warden, twice).

On one machine each takes the attempt's lease, an exclusive ``flock`` on
``unattended/lease.lock`` (freed by the kernel if its holder dies), and acts
only if ``claimed.json`` is not there yet, writing it first; the lease is held
while the actor saves state and stops, so a task that comes while a warden is
stopping waits for it and then uses what it saved.

Across machines the attempt's node agents decide: each actor asks every agent to
grant it the claim (``POST /v1/claim``); an agent grants the first claimer and
names it to the others. An actor takes the attempt when

- a strict majority of the attempt's agents grant it (a frozen node cannot keep
  a majority of the rest from deciding), or
- no agent that answers names another holder: then no one else can be using
  the agents (a rescue, a drain, stacks), and what is left, the stop, is safe
  to do twice (a frozen node of a two-node attempt, or agents already stopped).

Otherwise another actor holds it: the warden leaves, the task waits for what the
warden saved (:mod:`relay.recover.warden_record`). A network split that shows
each actor a disjoint set of agents could let both act; the cost is a rescue lost
(the retry resumes from the latest checkpoint), never a second decision.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.core.attempt import Attempt
from relay.launchers import Launcher
from relay.launchers.agent_client import MAX_PARALLEL
from relay.policy.model import CLAIM_SECONDS
from relay.recover.warden_record import CLAIM_FILE, LOCK_FILE, Stopped, folder
from relay_train.protocol.heartbeat import write_atomically
from relay_train.protocol.routes import BY, GRANTED, HOLDER, Route

TASK, WARDEN = "execute_complete", "warden"  # the two roles that may act on a fault
EARLY_CLAIM_MARGIN_SECONDS = 10.0  # covers clock skew between the triggerer and a worker

log = logging.getLogger(__name__)


def claimer(role: str) -> str:
    """Return a name for this actor that no other process on any machine has."""
    return f"{role} pid {os.getpid()} on {socket.gethostname()}"


@dataclass
class ClaimOutcome:
    """What the agents said to one claimer."""

    by: str
    nodes: list[str]
    granted: list[str] = field(default_factory=list)
    held_by: dict[str, str] = field(default_factory=dict)  # node -> the holder it named
    silent: list[str] = field(default_factory=list)

    @property
    def won(self) -> bool:
        """Return whether this claimer takes the attempt (see the module docstring)."""
        return 2 * len(self.granted) > len(self.nodes) or not self.held_by

    @property
    def holder(self) -> str | None:
        """Return the other actor most refusing agents named, if any."""
        named = list(self.held_by.values())
        return max(set(named), key=named.count) if named else None

    def describe(self) -> str:
        """Return e.g. ``granted by node-a, node-b; held by X at node-c; silent: node-d``."""
        parts = [f"granted by {', '.join(self.granted) or 'none'}"]
        parts += [f"held by {h} at {n}" for n, h in self.held_by.items()]
        if self.silent:
            parts.append(f"silent: {', '.join(self.silent)}")
        return "; ".join(parts)


def claim_attempt(launcher: Launcher, attempt: Attempt, by: str,
                  timeout: float = CLAIM_SECONDS) -> ClaimOutcome:
    """Ask every agent of ``attempt`` to grant ``by`` the claim."""
    channel = launcher.channel(attempt)
    nodes = sorted(channel.addresses)
    outcome = ClaimOutcome(by, nodes)
    if not nodes:
        return outcome

    def ask(node: str) -> tuple[str, dict[str, object] | None]:
        try:
            reply = channel.call(node, Route.CLAIM, body={BY: by}, timeout=timeout)
        except LookupError:  # an agent of another attempt: it grants nothing here
            return node, None
        return node, reply if isinstance(reply, dict) else None

    with ThreadPoolExecutor(max_workers=min(len(nodes), MAX_PARALLEL)) as pool:
        for node, reply in pool.map(ask, nodes):
            if reply is None:
                outcome.silent.append(node)
            elif reply.get(GRANTED):
                outcome.granted.append(node)
            else:
                outcome.held_by[node] = str(reply.get(HOLDER))
    log.info("Claim of %s by %s: %s (%s)", attempt, by, "taken" if outcome.won else "not taken",
             outcome.describe())
    return outcome


@contextmanager
def lease(attempt_dir: Path, wait_seconds: float | None) -> Iterator[bool]:
    """Hold the attempt's lease (``None``: wait as long as it takes); yield whether we got it."""
    where = folder(attempt_dir)
    where.mkdir(parents=True, exist_ok=True)
    with open(where / LOCK_FILE, "a") as lock:
        deadline = None if wait_seconds is None else time.monotonic() + wait_seconds
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.1)
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def claimed_by(attempt_dir: Path) -> dict[str, Any] | None:
    """Return who took the attempt (execute_complete or the warden), if anyone did."""
    try:
        return dict(json.loads((folder(attempt_dir) / CLAIM_FILE).read_text()))
    except (OSError, ValueError):
        return None


def write_claim(attempt_dir: Path, by: str) -> None:
    """Record that ``by`` took the attempt (fsynced: the other actor reads it next)."""
    write_atomically(folder(attempt_dir) / CLAIM_FILE, json.dumps(
        {"by": by, "pid": os.getpid(), "at": time.time()}), durable=True)


@dataclass
class Taken:
    """What the claim step found for one actor."""

    ours: bool  # this actor saves state and stops the attempt
    by_warden: Stopped | None = None  # what a warden already saved and stopped (task only)
    can_save: bool = True  # an agent answered the claim: there is someone to save from


@contextmanager
def take(attempt: Attempt, role: str, launcher: Launcher, *, wait_seconds: float,
         fetch: Callable[[], Stopped | None] | None = None,
         warden_due: float | None = None) -> Iterator[Taken]:
    """Take ``attempt`` for ``role``; hold its lease while the caller saves state and stops.

    The task waits (up to ``wait_seconds``) for a warden that is stopping the attempt
    right now: on this machine (its lease), or elsewhere (the agents name it; ``fetch``
    then brings what it saved). ``warden_due``: when a warden would claim the attempt
    (None: there is none); well before then the agents' claim is sent without waiting
    for their answers (a frozen agent's timeout stays off the recovery's path). The
    warden takes the attempt only if nobody did, and never waits.
    """
    where = attempt.runs_in
    with lease(where, 0.0 if role == WARDEN else wait_seconds) as held:
        if role == WARDEN:
            yield _warden_takes(attempt, launcher, held)
        elif not held:
            log.warning("The warden of %s still holds its lease after %.0fs; going on without "
                        "it", where, wait_seconds)
            yield Taken(True, Stopped.read(where))
        elif (claim := claimed_by(where)) is not None:
            stopped = Stopped.read(where)
            if stopped is None:
                log.warning("%s was claimed by %s, which left no record (it died?); handling "
                            "it in full", where, claim)
            yield Taken(True, stopped)
        else:
            write_claim(where, TASK)
            yield Taken(True, _task_claims(attempt, launcher, wait_seconds, fetch, warden_due))


def _warden_takes(attempt: Attempt, launcher: Launcher, held: bool) -> Taken:
    """Return whether the warden acts: nobody took the attempt, and the agents agree."""
    if not held or claimed_by(attempt.runs_in) is not None:
        return Taken(False)
    outcome = claim_attempt(launcher, attempt, claimer(WARDEN))
    if not outcome.won:  # execute_complete (or another warden) elsewhere has it
        log.warning("%s is held by %s (agents: %s); leaving it", attempt, outcome.holder,
                    outcome.describe())
        return Taken(False)
    write_claim(attempt.runs_in, WARDEN)
    return Taken(True, can_save=bool(outcome.granted) or not outcome.nodes)


def _task_claims(attempt: Attempt, launcher: Launcher, wait_seconds: float,
                 fetch: Callable[[], Stopped | None] | None,
                 warden_due: float | None) -> Stopped | None:
    """Claim the attempt from its agents for the task; return what a warden elsewhere
    saved if one holds it."""
    if warden_due is None:
        return None
    by = claimer(TASK)
    if time.time() < warden_due - EARLY_CLAIM_MARGIN_SECONDS:
        threading.Thread(target=claim_attempt, args=(launcher, attempt, by),
                         name="relay-claim", daemon=True).start()
        return None
    outcome = claim_attempt(launcher, attempt, by)
    if outcome.won:
        return None
    log.warning("%s is held by %s (agents: %s); waiting up to %.0fs for what it saved",
                attempt, outcome.holder, outcome.describe(), wait_seconds)
    return _wait_for_results(attempt.runs_in, wait_seconds, fetch)


def _wait_for_results(attempt_dir: Path, wait_seconds: float,
                      fetch: Callable[[], Stopped | None] | None) -> Stopped | None:
    """Return the record of a warden on another machine once it is readable, else None."""
    deadline = time.monotonic() + wait_seconds
    while True:
        stopped = Stopped.read(attempt_dir)
        if stopped is None and fetch is not None:
            try:
                stopped = fetch()
            except Exception as exc:  # noqa: BLE001 - the store may be busy: look again
                log.info("The warden's record of %s is not readable yet (%s)", attempt_dir, exc)
        if stopped is not None:
            return stopped
        if time.monotonic() >= deadline:
            log.warning("No record from the warden of %s after %.0fs; handling it in full",
                        attempt_dir, wait_seconds)
            return None
        time.sleep(1.0)
