"""relay_train.protocol: the contracts both sides share, standard library only.

Which of relay_train Relay's side may import is an import-linter contract
(pyproject.toml, checked by `lint-imports` in `make test`); this test imports each
protocol module with torch made unimportable, which a static check cannot do.
"""

from __future__ import annotations

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

def test_every_contract_module_is_found() -> None:
    assert {"relay_train.protocol.routes", "relay_train.protocol.env",
            "relay_train.protocol.injection", "relay_train.protocol.heartbeat"} <= set(PROTOCOL)


@pytest.mark.parametrize("module", [*PROTOCOL, "relay_train.errors"])
def test_imports_only_the_standard_library(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", _LOADS, module], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"{module} needs more than the standard library:\n{done.stderr}"
    assert json.loads(done.stdout) == [], f"{module} imported {done.stdout.strip()}"
