"""Relay's worker side. Its public API, for training scripts, is re-exported here.

``init()`` returns the rank's :class:`~relay_train.api.Session`; see ``relay_train.api``
for the whole loop. Attributes load lazily, so the stdlib-only modules
(``heartbeat``, ``launch``, ``manifest``) stay importable without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NotUnderRelayError", "Session", "current", "init", "seed_step"]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - PEP 562 lazy re-export
    if name in __all__:
        from relay_train import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
