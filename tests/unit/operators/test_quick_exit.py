"""relay.operators.quick_exit: a process that opened Relay's lineage freezes its heap at exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Registered before Relay's handler, so it runs after it (exit handlers run last-in,
# first-out): it sees what the interpreter's final collections will see.
PROBE = """
import atexit, gc, sys
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))
{body}
"""


def _run(body: str, home: Path) -> str:
    code = PROBE.format(body=body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={"RELAY_HOME": str(home), "PATH": "/usr/bin:/bin"},
                          check=True)
    return done.stdout


def test_opening_the_lineage_freezes_the_heap_at_exit(tmp_path: Path) -> None:
    out = _run("from relay.operators.base import lineage_store\nlineage_store()\nlineage_store()",
               tmp_path)
    assert "frozen at exit: True" in out


def test_a_process_that_never_opened_it_exits_as_usual(tmp_path: Path) -> None:
    out = _run("import relay.operators.base", tmp_path)
    assert "frozen at exit: False" in out


def test_registering_twice_adds_one_handler() -> None:
    import atexit

    from relay.operators.quick_exit import freeze_heap_at_exit

    freeze_heap_at_exit()
    before = atexit._ncallbacks()
    freeze_heap_at_exit()
    assert atexit._ncallbacks() == before
