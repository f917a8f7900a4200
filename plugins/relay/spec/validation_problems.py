"""Turn a pydantic validation error into fixable problems: one :class:`Problem` per error,
naming the file, line, field, what was expected, what was found and how to fix it.

Generic, like :mod:`relay.spec.yamlsource` (which loads the YAML with its lines).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError

from relay.core.exceptions import ConfigError
from relay.spec.yamlsource import (
    MAPPING,
    TOP_LEVEL,
    UNION_TAG,
    FieldValueError,
    KeyPath,
    Problem,
    dotted,
    line_for,
)

M = TypeVar("M", bound=BaseModel)


def model_problems(model_cls: type[M], raw: dict, lines: Mapping[KeyPath, int], file: Path,
                   fixes: Mapping[str, str]) -> tuple[M | None, list[Problem]]:
    """Validate ``raw`` and return the instance (or None) and one Problem per error."""
    try:
        return model_cls.model_validate(raw), []
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    return None, [_problem(model_cls, raw, lines, str(file), fixes, err) for err in errors]


def validate_model(model_cls: type[M], raw: dict, lines: Mapping[KeyPath, int], file: Path,
                   fixes: Mapping[str, str]) -> M:
    """Validate ``raw`` against ``model_cls``; raise ConfigError listing every error."""
    instance, problems = model_problems(model_cls, raw, lines, file, fixes)
    if instance is None:
        raise ConfigError(problems, file)
    return instance


def _problem(model_cls: type[BaseModel], raw: dict, lines: Mapping[KeyPath, int], file: str,
             fixes: Mapping[str, str], err: Any) -> Problem:  # noqa: ANN401 - pydantic ErrorDetails
    """Turn one pydantic error into a Problem."""
    loc: KeyPath = tuple(p for p in err["loc"]
                         if not (isinstance(p, str) and p.startswith(UNION_TAG)))
    field = dotted(loc)
    kind = err["type"]
    ctx = err.get("ctx") or {}
    exc = ctx.get("error")
    present, value = _lookup(raw, loc)
    if kind == "missing":
        found = "nothing"
    elif isinstance(exc, FieldValueError) and exc.shown is not None:
        found = exc.shown
    else:
        found = repr(value if present else err.get("input"))
    known = _known_fields(model_cls, loc[:-1])
    expected = _expected(kind, ctx, err["msg"], known)
    if isinstance(exc, FieldValueError) and exc.fix:
        fix = exc.fix
    elif kind != "extra_forbidden" and field in fixes:
        fix = fixes[field]
    else:
        fix = _generic_fix(kind, loc, expected, known)
    return Problem(file, line_for(lines, loc), field, expected, found, fix)


_WORDING = {
    "missing": "this field to be set",
    **dict.fromkeys(("int_parsing", "int_type", "int_from_float"), "a whole number"),
    **dict.fromkeys(("float_parsing", "float_type"), "a number"),
    **dict.fromkeys(("bool_parsing", "bool_type"), "true or false"),
    **dict.fromkeys(("dict_type", "model_type", "model_attributes_type"), MAPPING),
    "finite_number": "a finite number",
    "string_type": "text",
    "list_type": "a list",
}
_CTX_WORDING = {
    "greater_than": "a number > {gt}",
    "greater_than_equal": "a number >= {ge}",
    "less_than": "a number < {lt}",
    "less_than_equal": "a number <= {le}",
    "multiple_of": "a multiple of {multiple_of}",
    "string_pattern_mismatch": "text matching {pattern}",
    "string_too_short": "text of at least {min_length} character(s)",
    "string_too_long": "text of at most {max_length} character(s)",
    "too_short": "at least {min_length} item(s)",
    "too_long": "at most {max_length} item(s)",
    "literal_error": "one of {expected}",
    "enum": "one of {expected}",
}


def _expected(kind: str, ctx: Mapping[str, Any], msg: str, known: list[str] | None) -> str:
    """Word what a pydantic error type expected, for a human."""
    if kind == "extra_forbidden":
        return f"no such field (known fields: {', '.join(known or [])})"
    if kind in _WORDING:
        return _WORDING[kind]
    if kind in _CTX_WORDING:
        try:
            return _CTX_WORDING[kind].format(**ctx)
        except (KeyError, IndexError):
            return msg
    exc = ctx.get("error")
    if isinstance(exc, FieldValueError):
        return exc.expected
    if exc is not None:
        text = str(exc)
        if text.startswith("expected ") and ", found " in text:
            return text[len("expected "):text.rindex(", found ")]
        return text
    return msg


def _generic_fix(kind: str, loc: KeyPath, expected: str, known: list[str] | None) -> str:
    """Suggest a fix when the caller gave none for this field."""
    leaf = str(loc[-1]) if loc else TOP_LEVEL
    where = f"under `{dotted(loc[:-1])}`" if len(loc) > 1 else "at the top level"
    if kind == "missing":
        return f"add a `{leaf}: <value>` line {where}"
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(leaf, known or [], n=1)
        if close:
            return f"rename `{leaf}` to `{close[0]}`, or remove it"
        return f"remove `{leaf}`; the fields allowed {where} are: {', '.join(known or [])}"
    return f"set {dotted(loc)} to {expected}"


def _lookup(raw: object, loc: KeyPath) -> tuple[bool, object]:
    """Return (True, value) for the value at ``loc`` in ``raw``, else (False, None)."""
    current = raw
    for part in loc:
        if not isinstance(current, dict | list):
            return False, None
        try:
            current = current[part]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, current


def _known_fields(model_cls: type[BaseModel], loc: KeyPath) -> list[str] | None:
    """Return the YAML keys of the model found at ``loc`` (None if it is not a model)."""
    current: object = model_cls
    for part in loc:
        model = _as_model(current)
        fields = {(f.alias or n): f for n, f in model.model_fields.items()} if model else {}
        if isinstance(part, str) and part in fields:
            current = fields[part].annotation
        else:
            args = get_args(current)
            if not args:
                return None
            current = args[-1]
    model = _as_model(current)
    if model is None:
        return None
    return [info.alias or name for name, info in model.model_fields.items()]


def _as_model(tp: object) -> type[BaseModel] | None:
    """Return ``tp`` or the first of its (nested) type arguments that is a pydantic model."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for candidate in get_args(tp):
        found = _as_model(candidate)
        if found is not None:
            return found
    return None
