"""A resident agent run in-process over a DAG run's folder (tests of residents and leases)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from processes import write_heartbeat_for

from relay_train.agent.resident import Resident, ready_file


@dataclass
class ResidentRun:
    """A DAG run's folder with one resident's folder in it, for a resident run in-process."""

    run: Path  # the DAG run's folder
    directory: Path  # its residents' folder
    node: str = "node-c"

    def ranks_beat_for(self, seconds: float) -> None:
        """Play a workload of the run whose rank 0 beats for ``seconds`` more."""
        beat = self.run / "segment-000" / "try-1" / "heartbeats" / "rank-0.json"
        beat.parent.mkdir(parents=True, exist_ok=True)
        write_heartbeat_for(beat, seconds)

    def resident(self, idle_seconds: float) -> Resident:
        """Return the node's resident (run it with ``.run()``: it returns when it leaves)."""
        return Resident(self.directory, self.node, idle_seconds=idle_seconds)

    def ready(self) -> bool:
        """Return whether the resident says it is ready (it takes that back when it leaves)."""
        return ready_file(self.directory, self.node).exists()
