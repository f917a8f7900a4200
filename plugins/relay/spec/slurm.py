"""The ``slurm:`` section of a job spec: where attempts run when ``launcher: slurm``.

What the operator provides (docs/slurm.md): Slurm's client commands, ``slurm.conf`` and
MUNGE on the machines Relay's tasks run on; on every node, ``python`` with the worker
package (relay_train) and the user's code installed, and a node-local folder for
attempts (``node_home``); the nodes reachable from Relay's machines at Slurm's
``NodeAddr`` on the agents' ports, and the tracking server reachable from the nodes.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from relay.spec.yamlsource import FROZEN


class SlurmSpec(BaseModel):
    """How segment attempts run as Slurm jobs."""

    model_config = FROZEN

    # Each node's own folder for attempt folders ({node}: its Slurm name): node-local disk.
    node_home: str = Field("/var/tmp/relay/{node}", strict=True, min_length=1)
    python: str = Field("python3", strict=True, min_length=1)  # with relay_train, on every node
    partition: str | None = Field(None, strict=True, min_length=1)
    sbatch_args: list[str] = Field(default_factory=list)  # e.g. ["--account=ml", "--time=6:00:00"]
    slurm_conf: str | None = Field(None, strict=True, min_length=1)  # else $SLURM_CONF
    # The agents' channel and the ranks' rendezvous: a port each, per attempt, from this range.
    ports: tuple[int, int] = (20000, 30000)
    # After its ranks end, an agent answers this long (Relay reads its final state), then the
    # job ends; Relay's stop ends it sooner.
    linger: float = Field(60.0, ge=0)
