"""Where a job spec's ``policy`` points: a policy's name in the policies folder
(``$RELAY_POLICIES_DIR``, default ``policies/`` in the repository) or a YAML path
relative to the spec's folder."""

from __future__ import annotations

import os
import re
from pathlib import Path

from relay.spec.yamlsource import KeyPath, Problem, line_for

POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
YAML_SUFFIXES = (".yaml", ".yml")
DEFAULT_POLICY = "default"


def policies_dir() -> Path:
    """Return ``$RELAY_POLICIES_DIR`` (default: ``policies`` in the repository)."""
    configured = os.environ.get("RELAY_POLICIES_DIR")
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parents[3] / "policies"


def policy_names() -> list[str]:
    """Return the names of the policies in :func:`policies_dir`, sorted."""
    folder = policies_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.yaml") if p.is_file())


def resolve_policy(policy: str, spec_file: Path) -> Path:
    """Return the file a spec's ``policy`` value refers to."""
    if policy.endswith(YAML_SUFFIXES):
        path = Path(policy).expanduser()
        return path if path.is_absolute() else Path(spec_file).parent / path
    return policies_dir() / f"{policy}.yaml"


def missing_policy_problem(raw: dict, lines: dict[KeyPath, int], path: Path) -> Problem | None:
    """Return a Problem if the spec's policy file does not exist."""
    policy = raw.get("policy", DEFAULT_POLICY)
    if not isinstance(policy, str):
        return None
    target = resolve_policy(policy, path)
    if target.is_file():
        return None
    names = policy_names()
    if names:
        fix = (
            f"set policy to one of: {', '.join(names)} (from {policies_dir()}), or to a "
            "path ending in .yaml relative to this spec's folder"
        )
    else:
        fix = (
            f"no policies found in {policies_dir()}: add {policies_dir() / 'default.yaml'} "
            "or point RELAY_POLICIES_DIR at a folder of policies"
        )
    found = f"{policy!r} ({target} does not exist)"
    return Problem(str(path), line_for(lines, ("policy",)), "policy", "an existing policy file",
                   found, fix)
