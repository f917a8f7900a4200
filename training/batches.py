"""Epochs over a ``DataLoader`` as Relay's steps: ``session.batches(loader)``.

A step is one batch of the loader on each rank, so an epoch is ``len(loader)``
steps and step ``s`` is batch ``s % len(loader)`` of epoch ``s // len(loader)``
(:func:`epoch_position`). ``len(loader)`` counts the last, smaller batch with
``drop_last=False`` and leaves it out with ``drop_last=True`` (a
``DistributedSampler`` first pads or trims the dataset to a multiple of the world
size, so every rank has as many batches).

Every epoch's order must be a function of the epoch alone, for a resumed run to
see the batches an uninterrupted run saw: a sampler with ``set_epoch`` (a
``DistributedSampler``) gets it; a ``RandomSampler`` (``shuffle=True``) gets its
generator seeded from (job seed, epoch). Resuming mid-epoch skips the batches
already trained by their *indices*: the loader's batch sampler (or sampler) is
advanced past them, and no sample is loaded, collated or sent to a worker.

The epoch is read through a ``DataLoader`` of its own with the loader's dataset,
samplers, collate function and worker settings (a subclass's own behaviour is not
kept; persistent workers last one epoch), seeded from (job seed, epoch) so its
workers' seeds leave the script's global RNG alone. An ``IterableDataset`` has no
indices to skip: it can start epochs, not resume inside one. Imports torch and the
standard library only.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler

from relay_train.examples.data import mix_seed

EPOCH_SEED_SALT = 0x45504F43  # "EPOC": epoch seeds apart from seed_step's (seed, step, rank)


def epoch_position(step: int, steps_per_epoch: int) -> tuple[int, int]:
    """Return (epoch, batch index in it) of ``step``: Relay's step <-> batch mapping."""
    if steps_per_epoch <= 0:
        raise ValueError(f"expected steps_per_epoch > 0, found {steps_per_epoch}")
    return divmod(step, steps_per_epoch)


def steps_per_epoch(loader: DataLoader, expected: int = 0) -> int:
    """Return ``len(loader)``; refuse one that differs from the spec's ``steps_per_epoch``."""
    try:
        length = len(loader)
    except TypeError:
        raise ValueError(
            "relay_train: session.batches(loader) expected a DataLoader with a length (its "
            "dataset a map-style Dataset, or an IterableDataset with __len__); found one "
            "without. Give the dataset a __len__, or loop over session.steps() instead."
        ) from None
    if length <= 0:
        raise ValueError(f"relay_train: session.batches(loader): the loader has {length} "
                         "batches per epoch; expected at least one (is the dataset empty?)")
    if expected and expected != length:
        raise ValueError(
            f"relay_train: the job spec's steps_per_epoch is {expected}, but len(loader) is "
            f"{length} on this rank. A step is one batch, so fix steps_per_epoch in the job "
            f"spec (steps_per_epoch: {length}), or the loader's batch size or sampler.")
    return length


class SkipSampler(Sampler[Any]):
    """A sampler (or batch sampler) that starts ``skip`` items into another one's order."""

    def __init__(self, inner: Iterable[Any], skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        assert isinstance(self.inner, Sized)
        return max(len(self.inner) - self.skip, 0)


def start_epoch(loader: DataLoader, epoch: int, seed: int) -> None:
    """Give the loader's sampler the epoch: ``set_epoch``, or a RandomSampler's seed."""
    sampler = loader.sampler
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    elif isinstance(sampler, RandomSampler):
        if sampler.generator is None:
            sampler.generator = torch.Generator()
        sampler.generator.manual_seed(mix_seed(seed, epoch, EPOCH_SEED_SALT))


def epoch_loader(loader: DataLoader, epoch: int, start: int, seed: int) -> DataLoader:
    """Return a loader over ``epoch`` of ``loader`` from its batch ``start`` on."""
    start_epoch(loader, epoch, seed)
    if isinstance(loader.dataset, IterableDataset):
        if start:
            raise ValueError(
                f"relay_train: cannot resume inside epoch {epoch} at batch {start}: the "
                "loader's dataset is an IterableDataset, which has no indices to skip to. "
                "Use a map-style Dataset, or make steps_per_segment and checkpoint_every "
                "multiples of the epoch length.")
        return loader
    if loader.batch_sampler is not None:
        batching: dict[str, Any] = {"batch_sampler": SkipSampler(loader.batch_sampler, start)}
    else:  # batch_size=None: the sampler's items are the batches
        batching = {"sampler": SkipSampler(loader.sampler, start), "batch_size": None}
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch, EPOCH_SEED_SALT, 1))
    return DataLoader(
        loader.dataset, **batching, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=generator,
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        in_order=loader.in_order)


def epoch_batches(loader: DataLoader, steps: Iterable[int], *, seed: int,
                  expected_per_epoch: int = 0) -> Iterator[tuple[int, int, Any]]:
    """Yield (epoch, batch index, batch) for each of ``steps`` (consecutive step numbers)."""
    per_epoch = steps_per_epoch(loader, expected_per_epoch)
    batches: Iterator[Any] | None = None
    current = -1
    for step in steps:
        epoch, index = epoch_position(step, per_epoch)
        if epoch != current or batches is None:
            batches, current = iter(epoch_loader(loader, epoch, index, seed)), epoch
        try:
            batch = next(batches)
        except StopIteration:
            raise RuntimeError(
                f"relay_train: epoch {epoch} of the loader ended after {index} batches; "
                f"expected {per_epoch} (len(loader)). Its sampler yields fewer batches than "
                "its length says; fix the sampler's __len__.") from None
        yield epoch, index, batch
