"""Two checkpoints compared bit for bit: the first tensor (and element) where they differ.

A checkpoint is a nest of dicts, lists and tuples with tensors and plain values at the
leaves (``relay_train`` saves it with ``torch.save``). Leaves are compared in the first
checkpoint's order, floating tensors by their bits (so a NaN equals the same NaN and
``0.0`` differs from ``-0.0``). torch is imported when a comparison runs, not before.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

RNG_KEY = "rng"  # Relay's RNG states in a checkpoint (relay_train.rng)
MISSING = "(missing)"


@dataclass(frozen=True)
class Difference:
    """Where two checkpoints first differ: a leaf's name, an element's index, both values."""

    name: str
    index: tuple[int, ...] | None
    first: str
    second: str

    def describe(self, first: str = "first", second: str = "second") -> str:
        """Return it as a sentence, naming the two checkpoints ``first`` and ``second``."""
        where = self.name + ("" if self.index is None else str(list(self.index)))
        return f"{where}: {self.first} ({first}) vs {self.second} ({second})"


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:  # noqa: ANN401
    """Yield (dotted name, value) for every leaf of a nest of dicts, lists and tuples."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from leaves(value, f"{prefix}[{i}]")
    else:
        yield prefix, tree


def _bits(tensor: Any) -> Any:  # noqa: ANN401 - a torch.Tensor
    import torch

    if not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.contiguous().view(ints[tensor.element_size()])


def _tensor_difference(name: str, a: Any, b: Any) -> Difference | None:  # noqa: ANN401
    if a.dtype != b.dtype or a.shape != b.shape:
        return Difference(name, None, f"{a.dtype} {list(a.shape)}", f"{b.dtype} {list(b.shape)}")
    bits_a, bits_b = _bits(a), _bits(b)
    if a.shape != bits_a.shape:  # a complex tensor: its bits have one more dimension
        bits_a, bits_b = bits_a.flatten(-2), bits_b.flatten(-2)
    unequal = (bits_a != bits_b).nonzero()
    if len(unequal) == 0:
        return None
    index = tuple(int(i) for i in unequal[0][: a.dim()])
    return Difference(name, index, repr(a[index].item()), repr(b[index].item()))


def first_difference(a: dict[str, Any], b: dict[str, Any], *,
                     skip: frozenset[str] = frozenset()) -> Difference | None:
    """Return where ``a`` and ``b`` first differ (leaves under a top-level key in ``skip``
    left out), or None when they are bit-identical."""
    import torch

    mine = {n: v for k, sub in a.items() if k not in skip for n, v in leaves(sub, str(k))}
    theirs = {n: v for k, sub in b.items() if k not in skip for n, v in leaves(sub, str(k))}
    for name, value in mine.items():
        if name not in theirs:
            return Difference(name, None, _short(value), MISSING)
        other = theirs[name]
        if torch.is_tensor(value) and torch.is_tensor(other):
            found = _tensor_difference(name, value, other)
            if found is not None:
                return found
        elif torch.is_tensor(value) or torch.is_tensor(other) or value != other:
            return Difference(name, None, _short(value), _short(other))
    extra = next((name for name in theirs if name not in mine), None)
    return None if extra is None else Difference(extra, None, MISSING, _short(theirs[extra]))


def count_tensors(state: dict[str, Any], skip: frozenset[str] = frozenset()) -> int:
    """Return how many tensors ``state`` holds (outside the top-level keys in ``skip``)."""
    import torch

    return sum(1 for k, sub in state.items() if k not in skip
               for _, v in leaves(sub) if torch.is_tensor(v))


def _short(value: Any) -> str:  # noqa: ANN401
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
