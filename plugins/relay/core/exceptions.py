"""Every error Relay raises on purpose, in one tree.

Each message says what was expected, what was found and what to do::

    RelayError
    ├── ConfigError            a job spec or policy file has problems (file:line, field, fix)
    ├── InvalidJobSpecError    one or more job specs could not become DAGs
    ├── ChaosConfError         a DAG run's ``chaos`` conf is not allowed or not valid
    ├── PathEscapeError        a path from run conf points outside the folders it may use
    ├── NotEnoughNodesError    fewer healthy nodes than a segment needs
    ├── PoolStoreError         the node pool's state cannot be read or written
    ├── StaleAgentError        an agent answered for another attempt (fencing)
    ├── ChannelCAError         the channel's TLS CA cannot be read from its Secret
    ├── NotOursError           a recorded PID may now belong to another process
    ├── IllegalTransitionError an attempt was asked to take a step its state machine forbids
    ├── ReplayError            nothing to replay, or a bad argument
    ├── ServiceError           a service of ``make up`` did not start or answer
    └── ChaosTargetError       the thing ``relay chaos`` should break was not found

Built-in bases are kept where callers catch them (``ValueError``, ``LookupError``,
``RuntimeError``). The worker side's errors are in :mod:`relay_train.errors`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relay.spec.yamlsource import Problem


class RelayError(Exception):
    """Base of every error Relay raises on purpose."""


class ConfigError(RelayError):
    """Carry every problem found in one config file."""

    def __init__(self, problems: Iterable[Problem], file: str | Path | None = None) -> None:
        self.problems: list[Problem] = list(problems)
        if file is None:
            file = self.problems[0].file if self.problems else "<config>"
        self.file = str(file)
        super().__init__(self.problems, self.file)

    def __str__(self) -> str:
        n = len(self.problems)
        head = f"{self.file}: {n} problem{'' if n == 1 else 's'}"
        return "\n".join([head, *(str(p) for p in self.problems)])


class InvalidJobSpecError(RelayError):
    """One or more job specs (or their policies) could not be turned into DAGs."""


class ChaosConfError(RelayError, ValueError):
    """The DAG run conf's ``chaos`` is not allowed for this job, or not valid."""


class PathEscapeError(RelayError, ValueError):
    """A path from run conf or a param points outside the folders it may use."""


class NotEnoughNodesError(RelayError):
    """Fewer healthy nodes than a segment needs."""


class PoolStoreError(RelayError, RuntimeError):
    """The node pool's state cannot be read or written; the message says what to do."""


class StaleAgentError(RelayError, LookupError):
    """An agent answered for another attempt than the one asked about."""


class ChannelCAError(RelayError, RuntimeError):
    """The channel's TLS CA cannot be had from its Secret (message: expected, found, to do)."""


class NotOursError(RelayError, LookupError):
    """A recorded process is gone and its PID (or PGID) may now belong to another process."""


class IllegalTransitionError(RelayError, RuntimeError):
    """An attempt was asked to take a step its state machine forbids (a bug in Relay)."""


class ReplayError(RelayError):
    """Nothing to replay, or a bad argument."""


class ServiceError(RelayError, RuntimeError):
    """A service of `make up` did not start, answer or behave as expected."""


class ChaosTargetError(RelayError):
    """The thing to break could not be found."""
