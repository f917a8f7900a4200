"""Paths that come from a DAG run's conf or params stay inside the folders they belong to.

Anyone who can trigger a DAG can type a path; without these checks a run conf
could point Relay at any folder or file on the machine (``../../etc``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from relay.core import settings
from relay.core.exceptions import PathEscapeError

ENV_WATCH_ROOTS = "RELAY_WATCH_ROOTS"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]+")


def watch_roots() -> list[Path]:
    """Return the folders external heartbeat folders may be in (``RELAY_WATCH_ROOTS``,
    separated by ``os.pathsep``; default: ``$RELAY_HOME``)."""
    raw = os.environ.get(ENV_WATCH_ROOTS, "")
    roots = [Path(p) for p in raw.split(os.pathsep) if p.strip()]
    return roots or [settings.relay_home()]


def inside(path: str | Path, roots: Sequence[Path], field: str, fix: str) -> Path:
    """Return ``path`` resolved, if it is inside one of ``roots``; else raise PathEscapeError."""
    resolved = Path(path).expanduser().resolve()
    for root in roots:
        if resolved.is_relative_to(Path(root).expanduser().resolve()):
            return resolved
    where = ", ".join(str(r) for r in roots)
    raise PathEscapeError(f"{field}: expected a path inside {where}, found {str(path)!r} "
                          f"(resolves to {resolved}). Fix: {fix}")


def safe_name(name: str) -> str:
    """Return ``name`` as one folder name: no separators, never ``.``/``..`` or hidden."""
    cleaned = _SAFE_NAME.sub("_", name)
    return f"_{cleaned}" if cleaned.startswith(".") or not cleaned else cleaned
