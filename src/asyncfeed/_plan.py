"""The index plan: which samples go into which batch, decided before any I/O.

The plan is built from the same sampler objects DataLoader builds, in the same
order and drawing from the same generator, so the batches are DataLoader's
batches.  It is pulled lazily, in the consumer's thread, as batch slots free
up: a sampler that draws from the global RNG does so in the thread and at the
moment DataLoader would.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import (BatchSampler, IterableDataset, RandomSampler, Sampler,
                              SequentialSampler)


def is_iterable_dataset(dataset: Any) -> bool:
    """DataLoader's rule: an IterableDataset instance is iterated, anything else indexed."""
    return isinstance(dataset, IterableDataset)


def validate(dataset: Any, batch_size: int | None, shuffle: bool | None, sampler: Any,
             batch_sampler: Any, drop_last: bool) -> None:
    """Raise ValueError for the argument combinations DataLoader rejects."""
    if is_iterable_dataset(dataset):
        if shuffle not in (None, False):
            raise ValueError(f"DataLoader with IterableDataset: expected unspecified shuffle "
                             f"option, but got shuffle={shuffle}")
        if sampler is not None:
            raise ValueError(f"DataLoader with IterableDataset: expected unspecified sampler "
                             f"option, but got sampler={sampler}")
        if batch_sampler is not None:
            raise ValueError(f"DataLoader with IterableDataset: expected unspecified "
                             f"batch_sampler option, but got batch_sampler={batch_sampler}")
    else:
        if not hasattr(dataset, "__getitem__"):
            raise TypeError(f"{type(dataset).__name__} is neither a map-style dataset "
                            "(__getitem__ and __len__) nor an IterableDataset")
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError("batch_sampler option is mutually exclusive with batch_size, "
                             "shuffle, sampler, and drop_last")
    elif batch_size is None and drop_last:
        raise ValueError("batch_size=None option disables auto-batching and is mutually "
                         "exclusive with drop_last")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size <= 0):
        raise ValueError(f"batch_size should be a positive integer value, got {batch_size!r}")


class IndexPlan:
    """Builds, per epoch, the iterator of batches of indices (lists), or of single
    indices when auto-batching is off (``batch_size=None``)."""

    def __init__(self, dataset: Any, batch_size: int | None, shuffle: bool, sampler: Any,
                 batch_sampler: Any, drop_last: bool, generator: torch.Generator | None,
                 seed: int | None) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_last = drop_last
        self.user_sampler = sampler
        self.user_batch_sampler = batch_sampler
        self.generator = generator
        self.seed = seed
        self.auto_collation = batch_sampler is not None or batch_size is not None

    def _sampler(self, epoch: int) -> Sampler | Iterable[int]:
        if self.user_sampler is not None:
            return self.user_sampler
        if not self.shuffle:
            return SequentialSampler(self.dataset)
        if self.generator is None and self.seed is not None:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            return RandomSampler(self.dataset, generator=g)
        return RandomSampler(self.dataset, generator=self.generator)

    def index_sampler(self, epoch: int) -> Iterable[Any]:
        """DataLoader's ``_index_sampler`` for this epoch."""
        if self.user_batch_sampler is not None:
            return self.user_batch_sampler
        sampler = self._sampler(epoch)
        if self.batch_size is None:
            return sampler
        return BatchSampler(sampler, self.batch_size, self.drop_last)

    def start(self, epoch: int) -> Iterator[Any]:
        """The epoch's batches, consuming the generator exactly as DataLoader's iter() does."""
        it = iter(self.index_sampler(epoch))
        # DataLoader draws its workers' base seed right after iter(sampler): keep the
        # generator's stream in step with it.
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        return it

    def __len__(self) -> int:
        return len(self.index_sampler(0))  # type: ignore[arg-type]


def islice_batches(it: Iterator[Any], n: int) -> list[Any]:
    """Up to ``n`` next items of ``it``."""
    return list(itertools.islice(it, n))
