"""Bounds on the YAML Relay reads: a size cap checked before parsing, and no anchors or aliases.

A YAML alias is expanded wherever it is used, so a few hundred bytes of nested
aliases (a "billion laughs") become millions of entries in whatever reads them:
the DAG processor, the line tracker, pydantic. Relay's specs and policies are
short, hand-written files that never need them, so the composer refuses the
first anchor or alias it meets, at its line, before anything is expanded; and a
file larger than :data:`MAX_YAML_BYTES` is refused before a byte of it is parsed.
"""

from __future__ import annotations

from pathlib import Path

import yaml

# The largest shipped policy is ~4 KB: 128 KiB leaves room for comments and long job specs.
MAX_YAML_BYTES = 128 * 1024
MAX_KB = MAX_YAML_BYTES // 1024
ALIAS_FIX = ("aliases (&name / *name) are not allowed in Relay YAML: write the values out "
             "where they are used")


class AliasRefused(yaml.MarkedYAMLError):
    """An anchor (``&name``) or alias (``*name``) met while composing: refused, not expanded."""

    def __init__(self, found: str, mark: yaml.Mark | None) -> None:
        super().__init__(problem=found, problem_mark=mark)
        self.found = found


class TooLarge(ValueError):
    """A YAML file over :data:`MAX_YAML_BYTES`, refused before parsing."""

    def __init__(self, size: int | None) -> None:
        self.size = size  # None: the size is unknown (a FIFO, a device), only over the cap
        self.shown = f"over {MAX_KB} KB" if size is None else shown_size(size)
        super().__init__(f"the file is {self.shown}; Relay reads at most {MAX_KB} KB")


def shown_size(size: int) -> str:
    """Return ``size`` bytes as "2.1 MB" or "140.0 KB"."""
    if size >= 1024 * 1024:
        return f"{size / (1024 * 1024):.1f} MB"
    return f"{size / 1024:.1f} KB"


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader whose composer refuses anchors and aliases instead of expanding."""

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        """Refuse an alias or an anchored node at its line; compose anything else as usual."""
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise AliasRefused(f"the alias *{event.anchor}", event.start_mark)
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise AliasRefused(f"the anchor &{anchor}", event.start_mark)
        return super().compose_node(parent, index)  # type: ignore[misc]


def read_bounded(path: Path) -> str:
    """Return the UTF-8 text of ``path``; raise :class:`TooLarge` past :data:`MAX_YAML_BYTES`.

    The size is checked before reading, and the read itself stops one character past
    the cap, so a file that grows, a FIFO or a device cannot make it read without end.
    """
    size = Path(path).stat().st_size
    if size > MAX_YAML_BYTES:
        raise TooLarge(size)
    with Path(path).open(encoding="utf-8") as stream:
        text = stream.read(MAX_YAML_BYTES + 1)
    if len(text) > MAX_YAML_BYTES:
        raise TooLarge(None)
    return text
