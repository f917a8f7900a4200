"""Relay's worker side. Its public API, for training scripts, is re-exported here.

``init()`` returns the rank's :class:`~relay_train.api.Session`; see ``relay_train.api``
for the whole loop, and ``relay_train.errors`` for what it raises. Attributes load
lazily, so the stdlib-only parts (the contracts both sides share, in
``relay_train.protocol``, and the errors) stay importable without torch.

The package, by role: ``protocol/`` (heartbeat, launch file, manifests, process
identity, the channel's routes and node states, environment variable names,
injected faults, the rescue and stacks files; standard library only), ``agent/``
(a node's agent and its HTTP server, standby and resident agents), the session
modules a rank runs (``api``, ``session_state``, ``batches``, ``local``, ``checkpoint``,
``dcp``, ``fetch``, ``publish``, ``rescue``, ``stacks``, ``inject``, ``boundary``,
``device``, ...),
``examples/`` and ``baselines/``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CorruptCheckpointError", "DeviceError", "NotUnderRelayError", "Session", "current", "init",
    "seed_step",
]

_ERRORS = frozenset({"CorruptCheckpointError", "DeviceError", "NotUnderRelayError"})


def __getattr__(name: str) -> Any:  # noqa: ANN401 - PEP 562 lazy re-export
    if name in _ERRORS:
        from relay_train import errors  # stdlib only: catching one needs no torch

        return getattr(errors, name)
    if name in __all__:
        from relay_train import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
