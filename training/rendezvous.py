"""Wait for rank 0's rendezvous store before connecting to it.

With ``env://``, rank 0 starts the job's TCPStore when it calls
``init_process_group`` and every other rank connects to it. A rank that tries
before the store listens is refused, and torch's store client then sleeps a
fixed second before its next try (c10d's default connect backoff). Ranks often
do start first: another node's agent takes its launch a few milliseconds before
rank 0's, and rank 0 has more to set up (it publishes the checkpoints). Every
launch, a first segment's or a retry's, then loses most of that second.

A plain TCP connect every 10 ms finds the store as soon as it listens, and
torch's own connect then succeeds at once. The probe sends nothing and closes:
the store drops such a connection as a client that went away.
"""

from __future__ import annotations

import logging
import socket
import time

log = logging.getLogger(__name__)

PROBE_INTERVAL_SECONDS = 0.01
UNRESOLVED_INTERVAL_SECONDS = 0.25  # rank 0's name not in DNS yet (its pod not up): go easy
MAX_WAIT_SECONDS = 60.0  # after this, torch's own connect (and its timeout) takes over


def wait_for_store(host: str, port: int, timeout_seconds: float = MAX_WAIT_SECONDS,
                   interval_seconds: float = PROBE_INTERVAL_SECONDS) -> bool:
    """Return True once ``host:port`` accepts a TCP connection, False after
    ``timeout_seconds`` without one (torch's own connect then says what is wrong).

    The wait only saves torch's backoff, so a caller caps it well below the collective
    timeout: torch's connect waits that long again after it.
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=min(1.0, max(remaining, 0.01))):
                return True
        except OSError as exc:
            pause = UNRESOLVED_INTERVAL_SECONDS if isinstance(exc, socket.gaierror) \
                else interval_seconds
            if time.monotonic() + pause >= deadline:
                log.warning("rank 0's rendezvous store at %s:%d did not answer in %.0fs (%s); "
                            "torch's own connect takes over", host, port, timeout_seconds, exc)
                return False
            time.sleep(pause)
