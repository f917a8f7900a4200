"""The stacks exchange: where each rank's stacks and collective trace are written.

Relay asks every node's agent for its ranks' stacks over the channel (``POST
stacks``); the agent hands the request to its ranks as a file and reports their
answers (``GET stacks``). :mod:`relay_train.stacks` is the rank's side. In
``<attempt>/evidence/`` on the node: ``request.json`` (the agent: a request id),
then per rank ``fr/rank_<r>`` (the Flight Recorder dump as torch's pickle),
``fr-rank-<r>.json`` (the same as JSON) and ``rank-<r>.json`` (the stacks,
written last: it is the answer); ``faulthandler-rank-<r>.txt`` holds a C-level
dump, and ``faulthandler-rank-<r>.armed.json`` says who may be signalled for
one. Relay keeps what it received in the same layout, for MLflow and for torch's
analyzer. Stdlib only.
"""

from __future__ import annotations

from pathlib import Path

EVIDENCE_DIR = "evidence"  # in the attempt folder, on the node (and the MLflow artifact path)
REQUEST_FILE = "request.json"
FR_DIR = "fr"  # pickled dumps named rank_<r>: the layout torch's fr_trace analyzer reads


def answer_path(folder: Path, rank: int) -> Path:
    """Return the file holding ``rank``'s stacks (present once it answered)."""
    return folder / f"rank-{rank}.json"


def trace_path(folder: Path, rank: int) -> Path:
    """Return the file holding ``rank``'s Flight Recorder dump as JSON."""
    return folder / f"fr-rank-{rank}.json"


def fr_dump_path(folder: Path, rank: int) -> Path:
    """Return the file holding ``rank``'s Flight Recorder dump as torch's pickle."""
    return folder / FR_DIR / f"rank_{rank}"


def faulthandler_path(folder: Path, rank: int) -> Path:
    """Return where ``rank``'s faulthandler writes when signalled."""
    return folder / f"faulthandler-rank-{rank}.txt"


def armed_path(folder: Path, rank: int) -> Path:
    """Return the record saying ``rank``'s faulthandler is armed: its pid and host."""
    return folder / f"faulthandler-rank-{rank}.armed.json"
