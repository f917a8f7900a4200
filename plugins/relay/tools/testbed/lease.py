"""The machine's one test-bed lease: test beds share 198.18.0.0/24, so whoever brings a bed
up (a test's fixture, `relay demo --launcher slurm`) holds this lock while it is up, and
another waits for it instead of failing on the taken range."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LEASE = Path("/run/lock/relay-testbed-lease.lock")


@contextlib.contextmanager
def lease() -> Iterator[None]:
    """Hold the test-bed lease (wait for another bed to go first)."""
    LEASE.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LEASE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
