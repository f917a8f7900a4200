"""One rank: run the job's entrypoint as ``__main__``, as ``torchrun`` would.

A node agent forks this with torchrun's environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ...) plus Relay's (``RELAY_LAUNCH`` and the
segment's bounds). The entrypoint is the user's script or module from the job
spec, or the built-in example; it talks to Relay through ``relay_train`` only.
An entrypoint that cannot be found or imported fails here, with its own error
in the rank's log, which the agent reports and Relay classifies as a launch
failure. A script that returns cleanly before its segment's end fails too: the rank
exits ``SHORT_SEGMENT_EXIT`` with ``short_segment_message`` as its log's last line,
which Relay classifies as a ``short_segment`` fault.
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
import traceback
from pathlib import Path

from relay_train.protocol.env import ENV_NODE
from relay_train.protocol.launch import (
    SHORT_SEGMENT_EXIT,
    Entrypoint,
    LaunchConfig,
    short_segment_message,
)
from relay_train.timing import StartupClock

log = logging.getLogger("relay_train.worker")


def enter_world(entry: Entrypoint, attempt_dir: Path) -> str | None:
    """Give this rank the spec's world: ``entrypoint.env`` (its ``PYTHONPATH`` on
    ``sys.path`` too: the rank is a fork, its interpreter already running) and the working
    directory (``entrypoint.workdir``, else the attempt folder); return a problem, or None."""
    where = entry.workdir or (str(attempt_dir) if attempt_dir.is_dir() else None)
    if where is not None:
        try:
            os.chdir(where)
        except OSError as exc:
            return (f"relay: entrypoint.workdir {where}: {exc.strerror}. Expected a folder "
                    "on every node; fix entrypoint.workdir in the job spec.")
    os.environ.update(entry.env)
    extra = [os.path.abspath(p) for p in entry.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if entry.module and entry.workdir:
        extra.append(os.path.abspath(entry.workdir))  # as `python -m` would
    sys.path[:0] = [p for p in extra if p not in sys.path]
    return None


def run_entrypoint(entry: Entrypoint) -> int:
    """Run ``entry`` as ``__main__`` with its arguments; return its exit code."""
    if entry.module:
        sys.argv = [entry.module, *entry.args]
        run = lambda: runpy.run_module(entry.module, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script = Path(str(entry.script))
        if not script.is_file():
            print(f"relay: entrypoint script {script}: no such file. Expected a Python file; "
                  "fix entrypoint.script in the job spec (relative paths are relative to "
                  "the spec's folder).", file=sys.stderr)
            return 2
        sys.argv = [str(script), *entry.args]
        sys.path.insert(0, str(script.parent))
        run = lambda: runpy.run_path(str(script), run_name="__main__")  # noqa: E731
    try:
        run()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def run_rank(launch_file: Path) -> int:
    """Run this process's rank of the attempt in ``launch_file``; return its exit code."""
    rank = int(os.environ["RANK"])
    node = os.environ[ENV_NODE]
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {node} rank{rank} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,  # forked by the node agent: replace the agent's handler
    )
    StartupClock().mark("imports")
    cfg = LaunchConfig.read(launch_file)
    log.info("rank %d runs %s", rank, cfg.entrypoint.describe())
    problem = enter_world(cfg.entrypoint, cfg.root)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    try:
        code = run_entrypoint(cfg.entrypoint)
    except BaseException:  # noqa: BLE001 - a rank's death must reach its log and exit code
        traceback.print_exc()
        code = 1
    api = sys.modules.get("relay_train.api")  # a script that never imported it has no session
    session = api.current() if api is not None else None
    short = session.shortfall() if session is not None and code == 0 else None
    if session is not None and code == 0:
        session.close()  # the script forgot to: still publish what it saved
    elif session is not None:
        session.finish_publishing()
    if short is not None:  # a clean exit before the segment's end: the attempt fails
        print(short_segment_message(rank, *short), file=sys.stderr, flush=True)
        return SHORT_SEGMENT_EXIT
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m relay_train.worker --launch FILE``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--launch", type=Path, required=True)
    args = parser.parse_args(argv)
    return run_rank(args.launch)


def exit_now(code: int) -> None:
    """Leave the process at once: flush logs and stdio, skip interpreter teardown.

    Everything that matters (checkpoints, result.json, the last heartbeat) is
    written before the session closes; DDP objects are never freed (see
    ``relay_train.timing._KEEP_ALIVE``).
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
