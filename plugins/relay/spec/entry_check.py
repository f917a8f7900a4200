"""Before any node is taken: can the ranks import what the entrypoint imports?

A missing package would otherwise show up only at launch, as every rank's launch
failure. The check imports, in a fresh interpreter with the ranks' environment (the
spec's ``entrypoint.env``, its ``workdir`` as the working directory), the entrypoint's
top-level package (``mypkg`` of ``module: mypkg.train``), or, for a script, the
packages its top-level ``import`` statements name (the script itself is not run). The
interpreter is the spec's ``entrypoint.python`` if it names one (Relay's worker side,
and what it needs, is then imported there first), else Relay's own. It runs in ``relay
spec check`` and in the DAG's preflight task, for the local launcher (a Kubernetes pod's
image is another environment).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from relay.spec.job import JobSpec
from relay.spec.yamlsource import line_for, load_yaml_with_lines
from relay_train.protocol.interpreter import interpreter_env, worker_path
from relay_train.protocol.launch import Entrypoint

TIMEOUT_SECONDS = 120.0  # importing torch on a loaded machine takes seconds
# What a rank started with the spec's interpreter imports of Relay's (torch, NumPy, MLflow).
WORKER_IMPORTS = [("relay_train.api", "Relay's worker side (torch, NumPy)"),
                  ("relay_train.checkpoints.publish", "Relay's checkpoint publisher (MLflow)")]

# Run by the fresh interpreter: import each (name, where) of argv[1]; say the first failure.
_IMPORTER = """
import importlib, json, sys
if sys.path and sys.path[0] == "":
    del sys.path[0]  # no working directory on sys.path, as in a rank (-P is 3.11's only)
for extra in json.loads(sys.argv[2]):
    sys.path.insert(0, extra)
for name, where in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except BaseException as exc:
        missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
        print(json.dumps({"name": name, "where": where, "missing": missing,
                          "error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(3)
print(json.dumps({"ok": sys.version.split()[0]}))
"""
OK_KEY = "ok"  # the importer's last line when every import worked: this Python's version


def script_imports(script: Path) -> list[tuple[str, str]]:
    """Return (top-level package, "file:line") for each absolute import at a script's top
    level (inside ``if``/``try`` blocks too, not inside functions)."""
    tree = ast.parse(script.read_text(), filename=str(script))
    found: dict[str, str] = {}
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            if isinstance(node, ast.If | ast.Try):
                pending[:0] = [*node.body, *getattr(node, "orelse", []),
                               *getattr(node, "finalbody", [])]
            continue
        for name in names:
            found.setdefault(name.split(".")[0], f"{script}:{node.lineno}")
    return list(found.items())


def entry_imports(entry: Entrypoint) -> tuple[list[tuple[str, str]], list[str]]:
    """Return what to import for ``entry`` and the folders a rank has on ``sys.path``."""
    if entry.module:
        top = entry.module.split(".")[0]
        return [(top, f"entrypoint.module {entry.module}")], \
            [entry.workdir] if entry.workdir else []
    script = Path(str(entry.script))
    return script_imports(script), [str(script.parent)]


def import_problem(spec: JobSpec, spec_file: Path) -> str | None:
    """Return what the ranks of ``spec`` would fail to import (with the fix), or None."""
    if spec.entrypoint is None or spec.launcher != "local":
        return None  # the built-in example ships with Relay; a pod's image is not here
    entry = spec.launch_entrypoint(spec_file)
    if entry.workdir is not None and not Path(entry.workdir).is_dir():
        return (f"{spec_file}: entrypoint.workdir: expected a folder, found none at "
                f"{entry.workdir}. Create it, or fix the path (relative paths are relative "
                "to the spec's folder).")
    if entry.script is not None and not Path(entry.script).is_file():
        return (f"{spec_file}: entrypoint.script: expected a Python file, found none at "
                f"{entry.script}. Fix the path (relative to the spec's folder).")
    python = entry.python or sys.executable
    if entry.python is not None and not os.access(entry.python, os.X_OK):
        return (f"{_where(spec_file)}: entrypoint.python: expected a Python interpreter (or a venv "
                f"folder with bin/python), found {_what_is(Path(entry.python))} at "
                f"{entry.python}. Make one layered on Relay's environment (relay spec venv "
                "DIR; see docs/worker-api.md), or fix the path (relative to the spec's "
                "folder), or remove entrypoint.python to use Relay's own.")
    try:
        names, path = entry_imports(entry)
    except SyntaxError as exc:
        return f"{spec_file}: entrypoint.script {entry.script}: {exc}"
    env = {**os.environ, **entry.env}
    with tempfile.TemporaryDirectory(prefix="relay-import-check-") as scratch:
        if entry.python is not None:  # as the agent starts such a rank (ranks.exec_rank)
            names = [*WORKER_IMPORTS, *names]
            env = interpreter_env(env, worker_path(Path(scratch)))
        try:
            done = subprocess.run(
                [python, "-c", _IMPORTER, json.dumps(names), json.dumps(path)],
                cwd=entry.workdir or spec_file.parent, env=env,
                capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False)
        except subprocess.TimeoutExpired:
            return (f"{spec_file}: importing the entrypoint's packages took over "
                    f"{TIMEOUT_SECONDS:g}s in {python}; expected an import that returns.")
        except OSError as exc:  # not a program this machine can run
            return (f"{_where(spec_file)}: entrypoint.python: expected a Python interpreter, found "
                    f"{python} that does not start ({exc.strerror}). Fix the path, or "
                    "remove entrypoint.python to use Relay's own.")
    return _failure(spec_file, entry, python, done)


def _where(spec_file: Path) -> str:
    """Return ``file:line`` of the spec's entrypoint.python."""
    _, lines = load_yaml_with_lines(spec_file)
    line = line_for(lines, ("entrypoint", "python"))
    return f"{spec_file}:{line}" if line is not None else str(spec_file)


def _what_is(path: Path) -> str:
    if not path.exists():
        return "nothing"
    return "a folder without bin/python" if path.is_dir() else "a file that is not executable"


def _answer(stdout: str) -> dict[str, Any] | None:
    """Return the importer's answer: its last JSON line (an import may print after it at
    exit), or None."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict) and (OK_KEY in answer or "name" in answer):
            return answer
    return None


def _failure(spec_file: Path, entry: Entrypoint, python: str,
             done: subprocess.CompletedProcess[str]) -> str | None:
    """Return the message for a failed import check (None: it passed)."""
    failed = _answer(done.stdout)
    if done.returncode == 0 and failed is not None and OK_KEY in failed:
        return None
    if failed is None or "name" not in failed:  # the check never ran to its end
        said = (done.stderr.strip() or done.stdout.strip())[-500:] or "nothing"
        if entry.python is None:
            return (f"{spec_file}: checking the entrypoint's imports with {python} failed "
                    f"(exit code {done.returncode}): {said}")
        return (f"{_where(spec_file)}: entrypoint.python: expected a Python interpreter that "
                f"runs Relay's import check, found {python} that exited {done.returncode} "
                f"without its answer (it said: {said}). Name a Python 3 interpreter or a "
                "venv folder (relay spec venv DIR makes one), or remove entrypoint.python "
                "to use Relay's own.")
    missing = failed["missing"]
    fix = (f"install it into the ranks' environment ({python} -m pip install ...; the "
           f"package that provides {missing!r}), or add its folder to entrypoint.env's "
           "PYTHONPATH" if missing else "fix the error it raises")
    where = f"{spec_file}"
    if failed["name"] in dict(WORKER_IMPORTS):  # the interpreter's fault, not the script's
        where = f"{_where(spec_file)}: entrypoint.python"
        fix = (f"{fix}; or name a venv layered on Relay's environment (relay spec venv DIR "
               "makes one)")
    return (f"{where}: the ranks cannot import {failed['name']!r} ({failed['where']}): "
            f"{failed['error']}. Expected it importable with {python}, working directory "
            f"{entry.workdir or 'the attempt folder'} and entrypoint.env; {fix}.")
