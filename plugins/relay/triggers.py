"""The segment watcher: an async trigger that runs in Airflow's triggerer.

It gathers observations without blocking (file reads off the event loop),
asks :mod:`relay.faults` what they mean, and fires exactly one event:
``completed``, ``fault`` (with kind, culprit, evidence and detection time), or
``error`` (the watcher itself broke, with the traceback). It keeps no state
that matters across restarts, so running it twice is harmless.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from relay.faults import classify_exit
from relay.launchers.local import LaunchState, LocalLauncher


class SegmentWatchTrigger(BaseTrigger):
    """Watch one segment attempt until it completes or faults."""

    def __init__(
        self,
        attempt_dir: str,
        node_ranks: dict[str, list[int]],
        poll_interval_seconds: float = 0.5,
    ) -> None:
        super().__init__()
        self.attempt_dir = attempt_dir
        self.node_ranks = node_ranks
        self.poll_interval_seconds = poll_interval_seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Return the classpath and the exact ``__init__`` arguments."""
        return (
            "relay.triggers.SegmentWatchTrigger",
            {
                "attempt_dir": self.attempt_dir,
                "node_ranks": self.node_ranks,
                "poll_interval_seconds": self.poll_interval_seconds,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Poll until there is one thing to report, then report it."""
        launcher = LocalLauncher()
        root = Path(self.attempt_dir)
        try:
            while True:
                status = await asyncio.to_thread(launcher.status, root)
                if status.state is LaunchState.SUCCEEDED:
                    yield TriggerEvent({"status": "completed", "attempt_dir": self.attempt_dir})
                    return
                fault = classify_exit(status, self.node_ranks)
                if fault is not None:
                    yield TriggerEvent({**fault.to_event(), "attempt_dir": self.attempt_dir})
                    return
                await asyncio.sleep(self.poll_interval_seconds)
        except Exception as exc:  # an error event, never a dead trigger
            yield TriggerEvent(
                {
                    "status": "error",
                    "attempt_dir": self.attempt_dir,
                    "message": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                }
            )
