"""The job spec's ``checkpoint_every``: a number of steps, or ``auto`` within bounds.

A tagged union: pydantic names the member in an error's location (``~steps``,
``~auto``), which :mod:`relay.spec.yamlsource` leaves out of the field and line it
reports. How ``auto`` picks the interval: :mod:`relay.lineage.interval`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from relay.spec.yamlsource import FROZEN, UNION_TAG, FieldValueError


class AutoInterval(BaseModel):
    """``checkpoint_every: auto``: Relay picks the interval per attempt (Young/Daly), bounded.

    ``min`` and ``max`` are whole steps; ``max`` defaults to ``steps_per_segment``
    (a segment's end is always checkpointed). How the interval is chosen:
    :mod:`relay.lineage.interval`.
    """

    model_config = FROZEN

    auto: Literal[True] = True
    min: int = Field(1, strict=True, ge=1)
    max: int | None = Field(None, strict=True, ge=1)


def _interval_kind(value: object) -> str:
    """Tell a fixed number of steps from an ``auto`` section (pydantic's union tag)."""
    return f"{UNION_TAG}auto" if isinstance(value, dict | AutoInterval) else f"{UNION_TAG}steps"


def auto_shorthand(value: object, fix: str) -> object:
    """Read ``checkpoint_every: auto`` as ``{auto: true}``; refuse other words early."""
    if value == "auto":
        return {"auto": True}
    if isinstance(value, bool) or not isinstance(value, int | dict | AutoInterval):
        raise FieldValueError("a whole number of steps > 0, auto, or {auto: true, min: N, max: N}",
                              value, fix)
    return value


CheckpointEvery = Annotated[
    Annotated[int, Tag(f"{UNION_TAG}steps"), Field(strict=True, gt=0)]
    | Annotated[AutoInterval, Tag(f"{UNION_TAG}auto")],
    Discriminator(_interval_kind),
]


def auto_bounds(value: AutoInterval, per_segment: object) -> AutoInterval:
    """Require min <= max <= steps_per_segment."""
    high = value.max if value.max is not None else per_segment
    if isinstance(per_segment, int) and value.max is not None and value.max > per_segment:
        raise FieldValueError(
            f"checkpoint_every.max <= steps_per_segment ({per_segment})", value.max,
            f"lower checkpoint_every.max to at most {per_segment} (a segment's end is always "
            "checkpointed), or remove max to use steps_per_segment", shown=f"max: {value.max}")
    if isinstance(high, int) and value.min > high:
        raise FieldValueError(
            f"checkpoint_every.min <= checkpoint_every.max ({high})", value.min,
            f"lower checkpoint_every.min to at most {high}, e.g. {{auto: true, min: "
            f"{max(1, high // 4)}, max: {high}}}", shown=f"min: {value.min}")
    return value
