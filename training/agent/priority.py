"""CPU priority for work done beside running ranks: it must yield to them.

Two Linux facts decide how:

* a thread's nice value is its own, and threads and processes forked later do
  not take it from the thread that set it (``yielding_thread``);
* with autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled`` is 1, as
  on these machines) nice values only weigh threads of the same session against
  each other; sessions share the CPU equally first. A
  process that leads its own session (a resident agent, started with
  ``start_new_session``) gets as much CPU as a node's whole agent and ranks
  however nice its thread is, so such a process lowers its session's weight too
  (``yield_session``; ``restore_session`` once its work is wanted). The standbys it
  forks call ``setsid`` and start a new session of normal weight.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

NICE_INCREMENT = 10  # a preload beside running ranks yields to them (a tenth of their CPU weight)
AUTOGROUP = Path("/proc/self/autogroup")
RESTORE_ATTEMPTS = 10  # the kernel's host-wide limit: one autogroup change per 100 ms


def yielding_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """Start ``target`` in a daemon thread whose CPU priority is ``NICE_INCREMENT`` lower
    (on Linux a thread's nice value is its own: the threads forked later keep theirs)."""

    def work() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(os.getpriority(os.PRIO_PROCESS, tid) + NICE_INCREMENT, 19))
        target()

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    return thread


def session_nice(path: Path = AUTOGROUP) -> int | None:
    """Return this session's autogroup nice value (None: no autogroup scheduling here)."""
    try:
        return int(path.read_text().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return None


def yield_session(nice: int = 19, path: Path = AUTOGROUP) -> int | None:
    """Give this session the CPU weight of ``nice`` (autogroup nice; 19: the least Linux
    gives) if that is lower; return the nice value it had (None: left alone). Only a
    process that leads its own session may call it: every process of the session yields."""
    if os.getsid(0) != os.getpid():
        log.warning("pid %d does not lead its session: left its session's CPU weight alone "
                    "(lowering it would slow every process of the session)", os.getpid())
        return None
    current = session_nice(path)
    if current is None or current >= nice:
        return None
    try:
        path.write_text(str(nice))
    except OSError as exc:  # a kernel without autogroup, or a read-only /proc
        log.debug("could not lower this session's CPU weight: %s", exc)
        return None
    return current


def restore_session(nice: int, path: Path = AUTOGROUP) -> bool:
    """Give this session back the weight of ``nice`` (what ``yield_session`` returned);
    return whether it could. A negative ``nice`` needs CAP_SYS_NICE or an RLIMIT_NICE
    that allows it, and without CAP_SYS_ADMIN the kernel takes one change per 100 ms
    on the whole host (EAGAIN, retried here); a session that cannot keeps yielding
    (its work is only slower)."""
    for attempt in range(RESTORE_ATTEMPTS):
        try:
            path.write_text(str(nice))
            return True
        except OSError as exc:
            if exc.errno != errno.EAGAIN or attempt == RESTORE_ATTEMPTS - 1:
                log.info("this session keeps its lowered CPU weight (%s)", exc)
                return False
            time.sleep(0.1)
    return False
