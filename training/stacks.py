"""Where a rank is: every thread's Python stack and its Flight Recorder trace, on request.

When Relay detects a hang (or a silent rank or node) it asks every rank of the
attempt for evidence before it stops them, so the on-call engineer sees where
the job hung, not only that it did. A daemon thread answers from inside the
rank: a rank stuck in Python still lets it run (the interpreter switches
threads every few milliseconds) and a rank blocked in a gloo or NCCL wait has
released the GIL. For a main thread stuck in C code that holds the GIL the
thread cannot run; :mod:`faulthandler`, armed on :data:`FAULTHANDLER_SIGNAL`,
writes every thread's stack from its C signal handler instead.

The Flight Recorder (``TORCH_FR_BUFFER_SIZE``, set by the node agent before
``init_process_group``) keeps this process's last collectives, gloo as well as
NCCL: sequence id, op, sizes, whether it finished. Its dump is written twice:
as JSON for Relay's summary and as the pickle that torch's analyzer reads
(``python -m torch.distributed.flight_recorder.fr_trace <evidence>/fr``).

:func:`collect` is the answer; :class:`EvidenceResponder` is today's transport,
files in ``<attempt>/evidence/`` laid out as :mod:`relay_train.protocol.stacks_files`
says. Imports torch only to dump the trace, never Airflow.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

from relay_train.protocol.heartbeat import write_atomically
from relay_train.protocol.pids import start_time
from relay_train.protocol.routes import REQUEST_ID
from relay_train.protocol.stacks_files import (
    EVIDENCE_DIR,
    REQUEST_FILE,
    answer_path,
    armed_path,
    faulthandler_path,
    fr_dump_path,
    trace_path,
)

log = logging.getLogger(__name__)

ENV_FR_BUFFER = "TORCH_FR_BUFFER_SIZE"
FR_BUFFER_ENTRIES = 2000  # per process group: about 2000 steps of one collective each
FAULTHANDLER_SIGNAL = signal.SIGUSR2
POLL_SECONDS = 0.1
MAX_FRAMES = 64


def flight_recorder_environment() -> dict[str, str]:
    """Return the environment a rank needs for the Flight Recorder (a user's own value wins)."""
    return {ENV_FR_BUFFER: os.environ.get(ENV_FR_BUFFER, str(FR_BUFFER_ENTRIES))}


def thread_stacks(skip_current: bool = True) -> list[dict[str, Any]]:
    """Return every thread's Python stack, innermost frame last, the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    current = threading.get_ident()
    stacks = []
    for ident, frame in sys._current_frames().items():
        if skip_current and ident == current:
            continue
        frames = traceback.extract_stack(frame, limit=MAX_FRAMES)
        stacks.append({
            "thread": names.get(ident, f"thread-{ident}"),
            "main": ident == main,
            "frames": [{"file": f.filename, "line": f.lineno, "function": f.name,
                        "code": f.line or ""} for f in frames],
        })
    return sorted(stacks, key=lambda s: (not s["main"], s["thread"]))


def flight_recorder_dumps() -> tuple[dict[str, Any] | None, bytes | None]:
    """Return this process's Flight Recorder trace as parsed JSON and as torch's pickle."""
    dist = sys.modules.get("torch.distributed")  # never imported: no group (and no import)
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return None, None
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

    as_json = json.loads(_dump_fr_trace_json(True, False))
    # Without the collectives' stack traces: the first symbolization took ~6 s here, far
    # over the bound, and the thread stacks already show where each collective was called.
    as_pickle = pickle.loads(_dump_fr_trace(True, False, False))  # torch's own, this process
    return as_json, pickle.dumps(name_the_group(as_pickle))


def name_the_group(dump: dict[str, Any]) -> dict[str, Any]:
    """Fill in the group name that torch 2.13's gloo dump leaves empty in ``pg_config``.

    The analyzer matches entries to groups by that name and fails with a KeyError
    without it; with a single group in the entries the mapping is unambiguous.
    """
    config = dump.get("pg_config", {})
    groups = {tuple(e["process_group"]) for e in dump.get("entries", [])}
    if "" in config and len(groups) == 1:
        (name, desc), = groups
        config[name] = {**config.pop(""), "name": name, "desc": desc}
    return dump


def collect(
    rank: int, node: str, request_id: str
) -> tuple[dict[str, Any], dict[str, Any] | None, bytes | None]:
    """Return this rank's stacks record, and its Flight Recorder trace (JSON, pickle)."""
    started = time.perf_counter()
    record: dict[str, Any] = {
        "rank": rank, "node": node, "pid": os.getpid(), "request": request_id,
        "threads": thread_stacks(), "at": time.time(),
    }
    trace_json = trace_pickle = None
    try:
        trace_json, trace_pickle = flight_recorder_dumps()
    except Exception as exc:  # noqa: BLE001 - stacks are worth sending without the trace
        record["flight_recorder_error"] = f"{type(exc).__name__}: {exc}"
    record["flight_recorder"] = trace_json is not None
    record["seconds"] = round(time.perf_counter() - started, 4)
    return record, trace_json, trace_pickle


class EvidenceResponder:
    """Answer Relay's evidence requests from a daemon thread (files in the attempt folder)."""

    def __init__(self, attempt_dir: Path, rank: int, node: str,
                 poll_seconds: float = POLL_SECONDS) -> None:
        self.dir = attempt_dir / EVIDENCE_DIR
        self.rank = rank
        self.node = node
        self._poll = poll_seconds
        self._answered: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="evidence", daemon=True)
        self._faulthandler_file: IO[str] | None = None

    def start(self) -> None:
        """Arm the faulthandler fallback and start watching for a request."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._arm_faulthandler()
        self._thread.start()

    def close(self) -> None:
        """Stop watching (the segment ended normally)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _arm_faulthandler(self) -> None:
        """Have the C signal handler write all stacks to a file; announce it once armed."""
        path = faulthandler_path(self.dir, self.rank)
        self._faulthandler_file = open(path, "w")  # noqa: SIM115 - the handler keeps it open
        faulthandler.register(FAULTHANDLER_SIGNAL, file=self._faulthandler_file,
                              all_threads=True, chain=False)
        # Armed: who may signal (this pid, from this host only; the default action kills).
        write_atomically(armed_path(self.dir, self.rank), json.dumps(
            {"pid": os.getpid(), "started": start_time(os.getpid()),
             "host": socket.gethostname(), "signal": FAULTHANDLER_SIGNAL}))

    def _request(self) -> str | None:
        try:
            request = json.loads((self.dir / REQUEST_FILE).read_text())
        except (OSError, ValueError):
            return None  # none yet, or being written: look again next poll
        found = request.get(REQUEST_ID) if isinstance(request, dict) else None
        return str(found) if found is not None and found != self._answered else None

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            request_id = self._request()
            if request_id is None:
                continue
            self._answered = request_id
            try:
                self.respond(request_id)
            except Exception:  # noqa: BLE001 - Relay goes on without this rank's evidence
                log.exception("rank %d could not write its evidence", self.rank)

    def respond(self, request_id: str) -> Path:
        """Write the trace, then the stacks (the answer); return the answer's path."""
        record, trace_json, trace_pickle = collect(self.rank, self.node, request_id)
        if trace_pickle is not None:
            pickled = fr_dump_path(self.dir, self.rank)
            pickled.parent.mkdir(exist_ok=True)
            partial = pickled.with_name(f".{pickled.name}.partial")
            partial.write_bytes(trace_pickle)
            partial.replace(pickled)
        if trace_json is not None:
            write_atomically(trace_path(self.dir, self.rank), json.dumps(trace_json))
        path = answer_path(self.dir, self.rank)
        write_atomically(path, json.dumps(record, indent=1))
        log.warning("rank %d wrote its stacks and collective trace for Relay in %.3fs (%s)",
                    self.rank, record["seconds"], path)
        return path
