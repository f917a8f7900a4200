"""Take an attempt as the segment task does, for tests of the claim and the warden."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from relay.core.attempt import Attempt
from relay.launchers.local.launcher import LocalLauncher
from relay.recover import claim
from relay.recover.warden_record import Stopped


def take_as_task(attempt: Path, wait: float, launcher: LocalLauncher | None = None,
                 fetch: Callable[[], Stopped | None] | None = None,
                 warden_due: float | None = None) -> Stopped | None:
    """Take ``attempt`` as execute_complete does; return what a warden saved, if any."""
    with claim.take(Attempt(attempt), claim.TASK, launcher or LocalLauncher(),
                    wait_seconds=wait, fetch=fetch, warden_due=warden_due) as taken:
        assert taken.ours
        return taken.by_warden
