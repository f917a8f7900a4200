"""The exceptions the worker side raises, in one place (re-exported by ``relay_train``).

Each keeps the built-in base a script or a caller already catches it by::

    Exception
     +-- RuntimeError
     |    +-- NotUnderRelayError      (no longer raised: init() without Relay is local)
     |    +-- DeviceError             this node cannot run the ranks the way the spec asks
     +-- CorruptCheckpointError       a checkpoint does not match its manifest

Every message says what was expected, what was found, and what to do. Stdlib only:
the agent and Relay's side may catch these without importing torch.
"""

from __future__ import annotations

__all__ = ["CorruptCheckpointError", "DeviceError", "NotUnderRelayError"]


class NotUnderRelayError(RuntimeError):
    """The script was started without Relay's environment.

    ``relay_train.init()`` no longer raises it (outside Relay it returns a local
    session, :mod:`relay_train.local`); kept so that scripts catching it still import.
    """


class DeviceError(RuntimeError):
    """This node cannot run the ranks the way the spec asks (message: expected/found/fix)."""


class CorruptCheckpointError(Exception):
    """A checkpoint file does not match the sha256 its manifest promises."""
