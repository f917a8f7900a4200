"""relay_train.protocol: the contracts both sides share, standard library only, and the
only part of relay_train that Relay's side imports (but for the few named below)."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import relay_train.protocol

REPO = Path(__file__).resolve().parents[3]
PROTOCOL = sorted(f"relay_train.protocol.{m.name}"
                  for m in pkgutil.iter_modules(relay_train.protocol.__path__))

# Import one module with torch made unimportable; print the top-level packages it loaded
# that are neither the standard library nor relay_train itself.
_LOADS = """
import json, sys
sys.modules["torch"] = None
before = set(sys.modules)
__import__(sys.argv[1])
loaded = {name.split(".")[0] for name in set(sys.modules) - before}
print(json.dumps(sorted(loaded - set(sys.stdlib_module_names) - {"relay_train"})))
"""

# Relay's modules that may use more of relay_train than its protocol, and why.
MAY_USE_THE_WORKER_SIDE = {
    "launchers/local/": "starts and warms the agents (relay_train.agent)",
    "recover/ask_rescue.py": "publishes a rescued checkpoint (relay_train.publish)",
    "lineage/store.py": "MLflow's retry policy (relay_train.publish)",
    "tools/": "benchmarks and the demo run the worker side itself",
}


def test_every_contract_module_is_found() -> None:
    assert {"relay_train.protocol.routes", "relay_train.protocol.env",
            "relay_train.protocol.injection", "relay_train.protocol.heartbeat"} <= set(PROTOCOL)


@pytest.mark.parametrize("module", [*PROTOCOL, "relay_train.errors"])
def test_imports_only_the_standard_library(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", _LOADS, module], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"{module} needs more than the standard library:\n{done.stderr}"
    assert json.loads(done.stdout) == [], f"{module} imported {done.stdout.strip()}"


def _worker_side_imports(path: Path) -> list[str]:
    """Return the relay_train modules ``path`` imports, outside relay_train.protocol."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "relay_train":
                names = [f"relay_train.{alias.name}" for alias in node.names]
        found += [n for n in names if n.split(".")[0] == "relay_train"
                  and not n.startswith("relay_train.protocol")]
    return found


def test_relay_imports_only_the_protocol_of_the_worker_side() -> None:
    root = REPO / "plugins" / "relay"
    crossing = {}
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if any(where.startswith(allowed) for allowed in MAY_USE_THE_WORKER_SIDE):
            continue
        if imports := _worker_side_imports(path):
            crossing[where] = imports
    assert crossing == {}, (
        "Relay's side imports relay_train beyond relay_train.protocol; move the shared "
        f"names into relay_train.protocol (or name the exception and why): {crossing}")


def test_the_boundary_check_sees_a_crossing(tmp_path: Path) -> None:
    crossing = tmp_path / "crossing.py"
    crossing.write_text("from relay_train.stacks import answer_path\n"
                        "from relay_train import api\n"
                        "from relay_train.protocol.routes import Route\n")
    assert _worker_side_imports(crossing) == ["relay_train.stacks", "relay_train.api"]
