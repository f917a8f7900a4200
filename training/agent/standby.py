"""Standby agents: a node agent started before it is needed, that waits preloaded.

When Relay decides to retry a segment, it starts a standby agent on each node
the retry will use while it is still stopping the faulty attempt, publishing
the rescued state and waiting out the backoff, so that when the retry launches,
it only forks its ranks. A node the faulty attempt ran on, whose agent still
answers, gets a copy of that agent, forked on Relay's request over the channel
(``POST /v1/standby``): it is preloaded already, so it is ready at once. Any
other node gets a new process, which imports the training stack meanwhile
(seconds of CPU on a loaded host). A standby nobody takes within
``STANDBY_TTL_SECONDS`` leaves by itself.

The handshake, all in one folder per segment, ``<node>`` being the node name:

- ``<node>.standby``: written by the launcher when it starts the agent (pid);
- ``<node>.ready``: written by the agent once preloaded;
- the launcher takes it by renaming ``<node>.ready`` to ``<node>.taken``
  (atomic, so a standby that is timing out and a launcher never both win),
  then writes ``<node>.launch`` naming the launch file, or ``null`` to release it.

Stdlib only: the launcher side imports this without torch.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from pathlib import Path

from relay_train.protocol.heartbeat import write_atomically
from relay_train.protocol.routes import STANDBY_TTL_SECONDS

TAKEN_GRACE_SECONDS = 10.0  # from being taken to its launch file: written at once
DETACH_WAIT_SECONDS = 10.0  # a forked child calls setsid first thing: this is only a backstop


def standby_file(directory: Path, node: str) -> Path:
    """Return the launcher's record of the standby it started for ``node``."""
    return directory / f"{node}.standby"


def ready_file(directory: Path, node: str) -> Path:
    """Return the file a preloaded standby writes."""
    return directory / f"{node}.ready"


def taken_file(directory: Path, node: str) -> Path:
    """Return the name ``ready_file`` is renamed to by the launcher that takes the standby."""
    return directory / f"{node}.taken"


def launch_file(directory: Path, node: str) -> Path:
    """Return the file that hands a taken standby its launch file (or releases it)."""
    return directory / f"{node}.launch"


def announce_ready(directory: Path, node: str, preload_seconds: float) -> None:
    """Say this standby is preloaded and waiting."""
    write_atomically(ready_file(directory, node), json.dumps(
        {"pid": os.getpid(), "ready_at": time.time(), "preload_seconds": preload_seconds}))


def hand_over(directory: Path, node: str, launch: Path | None) -> None:
    """Give a taken standby its launch file, or ``None`` to let it go."""
    write_atomically(launch_file(directory, node),
                     json.dumps({"launch": str(launch) if launch else None}))


def fork_detached() -> int:
    """Fork a child that leads a session (and process group) of its own: return its PID
    in the parent, 0 in the child.

    The parent returns only once the child has left the parent's process group (or
    died), so stopping that group right after, as a launcher stopping the faulty
    attempt does, cannot take the child with it.
    """
    sys.stdout.flush()  # else the child writes the parent's buffered output again
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            os.setsid()
            os.write(write_end, b"s")
        except BaseException:  # noqa: BLE001 - the child must never return into the parent's code
            os._exit(1)
        os.close(write_end)
        return 0
    os.close(write_end)
    try:  # a byte once the child leads its session; EOF if it died before
        select.select([read_end], [], [], DETACH_WAIT_SECONDS)
    finally:
        os.close(read_end)
    return pid


def wait_for_launch(
    directory: Path, node: str, ttl_seconds: float = STANDBY_TTL_SECONDS, poll: float = 0.02
) -> Path | None:
    """Wait until taken; return the launch file, or None when released or untaken."""
    deadline = time.monotonic() + ttl_seconds
    handoff = launch_file(directory, node)
    taken_late = False
    while True:
        if handoff.exists():
            try:
                launch = json.loads(handoff.read_text())["launch"]
            except (OSError, ValueError, KeyError, TypeError):
                launch = None
            for f in (handoff, taken_file(directory, node)):
                f.unlink(missing_ok=True)
            return Path(launch) if launch else None
        if time.monotonic() >= deadline:
            if taken_late:
                return None  # taken, but the launch file never came
            expired = directory / f".{node}.expired"
            try:  # nobody took us: withdraw, unless a launcher takes us this instant
                os.rename(ready_file(directory, node), expired)
            except FileNotFoundError:
                taken_late = True
                deadline = time.monotonic() + TAKEN_GRACE_SECONDS
                continue
            expired.unlink(missing_ok=True)
            return None
        time.sleep(poll)
