"""How long a rank's training thread waited for a CPU: the machine's load, told apart.

A step on a host with more runnable threads than cores takes longer although the
rank's own work did not grow: its thread is ready but waits in the kernel's run queue.
Linux counts that time per thread (``/proc/thread-self/schedstat``, second field:
nanoseconds runnable but not running). A rank reports it beside its compute time, so
the watcher's performance rules can judge the work itself (compute less this wait) and
not take a loaded machine for a straggler or a slowed job. Time a rank sleeps
(I/O, a collective, a slow input pipeline) is not a wait for a CPU and stays counted;
so is time its thread is blocked on the GIL or a lock held by another of its threads
(to the kernel that is a sleep too).

Where the file is missing (not Linux, no ``/proc``), :meth:`CpuWait.seconds` is None
and the heartbeat says nothing of it: the rules then judge wall-clock compute as before.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

SCHEDSTAT = "/proc/thread-self/schedstat"


class CpuWait:
    """The run-queue wait of the thread that made it (read from any thread)."""

    def __init__(self, path: str = SCHEDSTAT) -> None:
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY)
        except OSError as exc:
            log.debug("No CPU wait figures (%s): %s", path, exc)
            self._fd = None

    def seconds(self) -> float | None:
        """Return the seconds the thread has waited for a CPU so far (None: unknown)."""
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError) as exc:
            log.debug("Could not read the CPU wait: %s", exc)
            self.close()
            return None

    def close(self) -> None:
        """Close the file (later reads say None)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
