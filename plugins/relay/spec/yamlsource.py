"""Load YAML configs with line numbers and turn validation errors into fixable problems.

Generic: knows nothing about jobs or policies. A loader reads a file with
:func:`load_yaml_with_lines`, validates it with
:func:`~relay.spec.validation_problems.validate_model` (or ``model_problems`` when it
has checks of its own to add) and raises
:class:`ConfigError`, whose text names file, line, field, what was expected,
what was found and how to fix it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BeforeValidator, ConfigDict, WithJsonSchema

from relay.core.exceptions import ConfigError
from relay.spec.yamllimits import (
    ALIAS_FIX,
    MAX_KB,
    AliasRefused,
    BoundedLoader,
    TooLarge,
    read_bounded,
)

KeyPath = tuple[str | int, ...]
LineMap = dict[KeyPath, int]
# Every section of a spec or a policy: read-only once loaded, and an unknown key is a problem.
FROZEN = ConfigDict(frozen=True, extra="forbid")

TOP_LEVEL = "(top level)"
SYNTAX = "(yaml syntax)"
FILE_SIZE = "(file size)"
ALIASES = "(yaml anchors and aliases)"
MAPPING = "a mapping of `key: value` settings"
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h))+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION_WORDING = "a duration such as 30s, 5m or 1h"
# Prefix of a tagged union member's name (pydantic puts the tag in an error's location);
# such parts are not YAML keys, so problems leave them out of the field and line.
UNION_TAG = "~"

# JSON Schema of a duration field, for editors: "30s", "5m", "1h30m", "500ms" or seconds.
DURATION_JSON_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "pattern": "^(\\d+(\\.\\d+)?(ms|s|m|h))+$"},
        {"type": "number", "minimum": 0},
    ],
    "description": "a duration such as 500ms, 30s, 5m or 1h (or a number of seconds)",
}


class FieldValueError(ValueError):
    """Report a bad value with what was expected and, optionally, a concrete fix."""

    def __init__(self, expected: str, found: object, fix: str | None = None,
                 shown: str | None = None) -> None:
        self.expected = expected
        self.found = repr(found) if shown is None else shown  # shown: the value, secrets removed
        self.shown = shown
        self.fix = fix
        super().__init__(f"expected {expected}, found {self.found}")


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a config file, with where it is and how to fix it."""

    file: str
    line: int | None
    field: str
    expected: str
    found: str
    fix: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return (
            f"{where}: {self.field}: expected {self.expected}, found {self.found}. Fix: {self.fix}"
        )


def parse_duration(value: object) -> float:
    """Return seconds from "500ms", "30s", "5m", "1h", "1h30m" or a plain number of seconds."""
    if isinstance(value, bool):
        raise FieldValueError(_DURATION_WORDING, value)
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        text = text.removeprefix("-")
        try:
            seconds = sign * float(text)
        except ValueError:
            if not _DURATION.fullmatch(text):
                raise FieldValueError(_DURATION_WORDING, value) from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in _DURATION_PART.findall(text))
    else:
        raise FieldValueError(_DURATION_WORDING, value)
    if not math.isfinite(seconds):
        raise FieldValueError(_DURATION_WORDING, value)
    if seconds < 0:
        raise FieldValueError(f"{_DURATION_WORDING} (not negative)", value)
    return seconds or 0.0  # no -0.0


def load_yaml_with_lines(path: Path, *, empty_fix: str | None = None) -> tuple[dict, LineMap]:
    """Safe-load a YAML mapping and map every key path to its 1-based line number.

    Bounded (:mod:`relay.spec.yamllimits`): a file over the size cap is refused before
    parsing, and an anchor or alias while composing, so nothing is ever expanded.
    """
    file = str(path)
    try:
        text = read_bounded(Path(path))
    except TooLarge as exc:
        problem = Problem(file, None, FILE_SIZE, f"a file of at most {MAX_KB} KB",
                          f"a file of {exc.shown}", f"{exc}: trim it (a spec or a policy is "
                          "a few KB), dropping generated or repeated content")
        raise ConfigError([problem]) from exc
    except (OSError, UnicodeDecodeError) as exc:
        fix = "check the path and that the file is readable UTF-8 text"
        problem = Problem(file, None, TOP_LEVEL, "a readable file", str(exc), fix)
        raise ConfigError([problem]) from exc
    duplicates: list[Problem] = []
    try:
        loader = BoundedLoader(text)
    except yaml.YAMLError as exc:  # a character YAML does not allow, found before parsing
        raise ConfigError([_syntax_problem(file, exc, text)]) from exc
    try:
        node = loader.get_single_node()
        lines: LineMap = {(): 1}
        if isinstance(node, yaml.MappingNode):
            _walk(loader, node, (), lines, _Duplicates(file, duplicates))
        if duplicates:
            raise ConfigError(duplicates, file)
        data = loader.construct_document(node) if node is not None else None
    except AliasRefused as exc:  # refused while composing: nothing was expanded
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else None
        problem = Problem(file, line, ALIASES, "values written out in full", exc.found, ALIAS_FIX)
        raise ConfigError([problem]) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([_syntax_problem(file, exc)]) from exc
    except RecursionError as exc:  # absurdly deep nesting
        problem = Problem(file, None, SYNTAX, "YAML nested at most a few hundred levels deep",
                          "nesting too deep to read", "flatten the file")
        raise ConfigError([problem]) from exc
    finally:
        loader.dispose()
    if data is None:  # no document, or only "---" / "~"
        fix = empty_fix or "write the settings as `key: value` lines"
        raise ConfigError([Problem(file, 1, TOP_LEVEL, MAPPING, "an empty file", fix)])
    if not isinstance(data, dict):
        found = f"{type(data).__name__} {data!r}"
        fix = "write the settings as `key: value` lines, starting at the left margin"
        line = node.start_mark.line + 1
        raise ConfigError([Problem(file, line, TOP_LEVEL, MAPPING, found, fix)])
    return data, lines


@dataclass
class _Duplicates:
    """Collect keys given twice in one mapping (YAML would silently keep the last)."""

    file: str
    found: list[Problem]

    def add(self, path: KeyPath, key: object, first: int, again: int) -> None:
        fix = (f"keep one `{key}:` (line {first} or line {again}) and delete the other; today "
               "the last one would silently win")
        self.found.append(Problem(self.file, again, dotted((*path, key)),
                                  "each key once per mapping",
                                  f"`{key}` on line {first} and again on line {again}", fix))


def _walk(loader: yaml.SafeLoader, node: yaml.Node, path: KeyPath, lines: LineMap,
          duplicates: _Duplicates) -> None:
    """Record the line of every key and list item under ``node``; collect duplicate keys.

    The nodes form a tree (the loader refuses aliases), so each is walked once.
    """
    if isinstance(node, yaml.MappingNode):
        seen: dict[object, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            try:
                key = loader.construct_object(key_node)
            except yaml.YAMLError:
                key = key_node.value
            if not isinstance(key, str | int):
                key = key_node.value
            line = key_node.start_mark.line + 1
            if key_node.tag != "tag:yaml.org,2002:merge":  # `<<:` merges may repeat
                try:
                    if key in seen:
                        duplicates.add(path, key, seen[key], line)
                    seen.setdefault(key, line)
                except TypeError:  # an unhashable key: PyYAML reports it when constructing
                    pass
            lines.setdefault((*path, key), line)
            _walk(loader, value_node, (*path, key), lines, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines.setdefault((*path, index), item.start_mark.line + 1)
            _walk(loader, item, (*path, index), lines, duplicates)


def _syntax_problem(file: str, exc: yaml.YAMLError, text: str = "") -> Problem:
    """Describe a YAML parse error as a Problem at its line."""
    line = None
    found = str(exc)
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        char = exc.character
        code = f"U+{char:04X}" if isinstance(char, int) else repr(char)
        found = f"the character {code}, which YAML does not allow ({exc.reason})"
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        found = " ".join(part for part in (exc.problem, exc.context) if part) or found
    found = found.removeprefix("found ")
    fix = (
        "fix the YAML on or just before this line: indent with spaces (not tabs), put "
        "`: ` after each key, and close every quote and bracket"
    )
    return Problem(file, line, SYNTAX, "valid YAML", found, fix)


def line_for(lines: Mapping[KeyPath, int], loc: Iterable[object]) -> int | None:
    """Return the line of ``loc`` or of its nearest ancestor that is in ``lines``."""
    parts = tuple(loc)
    for end in range(len(parts), -1, -1):
        line = lines.get(parts[:end])  # type: ignore[arg-type]
        if line is not None:
            return line
    return None


def dotted(loc: Iterable[object]) -> str:
    """Join a key path as ``model.d_model`` (``(top level)`` when empty)."""
    text = ".".join(str(part) for part in loc)
    return text or TOP_LEVEL


# A pydantic field type: reads "30s", "5m", "500ms" or a number into seconds (>= 0), and
# tells editors so through the JSON Schema.
Duration = Annotated[
    float, BeforeValidator(parse_duration), WithJsonSchema(DURATION_JSON_SCHEMA)
]
