"""Named pause points for tests that kill a task process at a precise moment.

Off unless ``RELAY_TEST_PAUSE_DIR`` is set (only the service tests set it). A
test asks for a pause by creating ``<dir>/<point>.request``; the first process
to reach that point takes the request, writes ``<dir>/<point>.paused`` (its
PID and what it was doing) and waits until that file is removed, at most
:data:`MAX_PAUSE_SECONDS`. The test then kills that PID as a crash would.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from relay_train.protocol.heartbeat import write_atomically

ENV = "RELAY_TEST_PAUSE_DIR"
MAX_PAUSE_SECONDS = 600.0

log = logging.getLogger(__name__)


def pause(point: str, **detail: str) -> None:
    """Wait here if a test asked to (see the module docstring); else return at once."""
    root = os.environ.get(ENV)
    if not root:
        return
    request = Path(root) / f"{point}.request"
    taken = request.with_suffix(f".taken-{os.getpid()}")
    try:
        os.rename(request, taken)  # one process takes one request
    except OSError:
        return
    paused = Path(root) / f"{point}.paused"
    write_atomically(paused, json.dumps({"pid": os.getpid(), **detail}))  # read once it exists
    log.warning("Test pause point %r: pid %d waits until %s is removed", point, os.getpid(),
                paused)
    deadline = time.monotonic() + MAX_PAUSE_SECONDS
    while paused.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
