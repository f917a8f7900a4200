"""A rank's own Python interpreter (the spec's ``entrypoint.python``).

Such a rank is not a fork of its agent: the agent starts ``python -m
relay_train.agent.ranks`` with that interpreter. The interpreter finds Relay's worker
package (this ``relay_train``, so both sides speak the same protocol) through a folder
that holds only a link to it, put first on its ``PYTHONPATH``; its own environment
provides the rest (torch, NumPy and, on the node that publishes checkpoints, MLflow).
The import preflight (``relay.spec.entry_check``) uses the same folder. Standard
library only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

WORKER_PACKAGE = "relay_train"
WORKER_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # training/ in a checkout
PATH_FOLDER = "relay_train_path"  # under the attempt folder: the link, alone
RANK_MODULE = "relay_train.agent.ranks"  # what the interpreter runs (``-m``)


def worker_path(base: Path) -> Path:
    """Return a folder (made under ``base``) that holds only a link to this ``relay_train``."""
    folder = base / PATH_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / WORKER_PACKAGE
    try:
        link.symlink_to(WORKER_PACKAGE_DIR, target_is_directory=True)
    except FileExistsError:  # another rank or agent of the attempt made it
        pass
    return folder


def interpreter_env(environ: Mapping[str, str], folder: Path) -> dict[str, str]:
    """Return ``environ`` with ``folder`` first on ``PYTHONPATH``."""
    rest = environ.get("PYTHONPATH", "")
    return {**environ, "PYTHONPATH": os.pathsep.join(p for p in (str(folder), rest) if p)}


def interpreter_of(path: str) -> str:
    """Return the interpreter a spec's ``entrypoint.python`` names: the file itself, or a
    venv folder's ``bin/python`` (not resolved: a venv's python is a link to its base)."""
    return str(Path(path) / "bin" / "python") if Path(path).is_dir() else path
