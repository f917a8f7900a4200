"""Helpers shared by the policy tests: find a key's line, load a policy expecting errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.core.exceptions import ConfigError
from relay.policy.model import load_policy


def line_of(path: Path, key: str) -> int:
    """Return the 1-based line on which ``key:`` is written (first occurrence)."""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip().startswith(f"{key}:"):
            return number
    raise AssertionError(f"{key} not in {path}")


def load_error(path: Path) -> ConfigError:
    """Load a policy that must be invalid; return the error."""
    with pytest.raises(ConfigError) as info:
        load_policy(path)
    return info.value
