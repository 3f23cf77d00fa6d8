"""The index plan: which samples go into which batch, decided before any I/O.

The plan is built from the same sampler objects DataLoader builds, in the same
order and drawing from the same generator, so the batches are DataLoader's
batches.  It is pulled lazily, in the consumer's thread, as batch slots free
up: a sampler that draws from the global RNG does so in the thread and at the
moment DataLoader would.
"""

from __future__ import annotations

import base64
import math
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


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The global order of an epoch as ``DistributedSampler`` draws it (before sharding)."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def distributed_indices(n: int, epoch: int, seed: int, shuffle: bool, rank: int,
                        world_size: int, drop_last: bool) -> list[int]:
    """Exactly the indices ``DistributedSampler`` gives ``rank`` for ``epoch``."""
    return shard(epoch_order(n, epoch, seed, shuffle), rank, world_size, drop_last)


def shard(order: list[int], rank: int, world_size: int, drop_last: bool) -> list[int]:
    """``DistributedSampler``'s split of ``order``: padded (repeating from the start)
    or truncated to a multiple of ``world_size``, then every ``world_size``-th item."""
    n = len(order)
    if drop_last and n % world_size:
        num = math.ceil((n - world_size) / world_size)
    else:
        num = math.ceil(n / world_size)
    total = num * world_size
    if not drop_last:
        pad = total - n
        if pad <= n:
            order = order + order[:pad]
        else:
            order = order + (order * math.ceil(pad / max(n, 1)))[:pad]
    else:
        order = order[:total]
    return order[rank:total:world_size]


def _gen_state_to_str(g: torch.Generator) -> str:
    return base64.b64encode(bytes(g.get_state().tolist())).decode("ascii")


def _gen_state_from_str(s: str) -> torch.Tensor:
    return torch.tensor(list(base64.b64decode(s)), dtype=torch.uint8)


class IndexPlan:
    """Builds, per epoch, the iterator of batches of indices (lists), or of single
    indices when auto-batching is off (``batch_size=None``).

    ``start`` also returns the *replay* record of the epoch: what is needed to
    rebuild exactly the same plan in another process (a sampler seed, or the
    generator's state before the epoch), so a checkpoint can skip the batches
    already consumed and redo the rest.
    """

    def __init__(self, dataset: Any, batch_size: int | None, shuffle: bool, sampler: Any,
                 batch_sampler: Any, drop_last: bool, generator: torch.Generator | None,
                 seed: int | None, rank: int = 0, world_size: int = 1) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_last = drop_last
        self.user_sampler = sampler
        self.user_batch_sampler = batch_sampler
        self.generator = generator
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.auto_collation = batch_sampler is not None or batch_size is not None
        self.sharded = world_size > 1 and sampler is None and batch_sampler is None

    def _sampler(self, epoch: int, sampler_seed: int | None = None) -> Sampler | Iterable[int]:
        if self.user_sampler is not None:
            return self.user_sampler
        if self.sharded:
            return distributed_indices(len(self.dataset), epoch, self.seed or 0, self.shuffle,
                                       self.rank, self.world_size, self.drop_last)
        if not self.shuffle:
            return SequentialSampler(self.dataset)
        if self.generator is None and self.seed is not None:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            return RandomSampler(self.dataset, generator=g)
        if self.generator is None and sampler_seed is not None:
            g = torch.Generator()
            g.manual_seed(sampler_seed)
            return RandomSampler(self.dataset, generator=g)
        return RandomSampler(self.dataset, generator=self.generator)

    def index_sampler(self, epoch: int, sampler_seed: int | None = None) -> Iterable[Any]:
        """DataLoader's ``_index_sampler`` for this epoch."""
        if self.user_batch_sampler is not None:
            return self.user_batch_sampler
        sampler = self._sampler(epoch, sampler_seed)
        if self.batch_size is None:
            return sampler
        return BatchSampler(sampler, self.batch_size, self.drop_last)

    @property
    def global_shuffle(self) -> bool:
        """Whether the order is drawn from torch's global RNG at each ``iter()``."""
        return (self.shuffle and self.user_sampler is None and not self.sharded
                and self.generator is None and self.seed is None)

    def predraw(self) -> dict[str, Any]:
        """Make now the global-RNG draws the next ``start`` would make (DataLoader's base
        seed, then the sampler's seed); hand the result to ``start(predrawn=True)``."""
        self.base_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        return {"sampler_seed": int(torch.empty((), dtype=torch.int64).random_().item())}

    def start(self, epoch: int, replay: dict[str, Any] | None = None, predrawn: bool = False
              ) -> tuple[Iterator[Any], dict[str, Any]]:
        """The epoch's batches, consuming RNG exactly as DataLoader's ``iter()`` does,
        and the epoch's replay record.  With ``replay`` (from an earlier ``start``),
        the same plan again; with ``predrawn``, ``replay`` is from ``predraw()`` and
        the global RNG is not drawn from again."""
        replay = dict(replay or {})
        if self.generator is not None:
            if "generator_state" in replay:
                self.generator.set_state(_gen_state_from_str(replay["generator_state"]))
            replay = {"generator_state": _gen_state_to_str(self.generator)}
        if self.global_shuffle:
            # DataLoader: iter(sampler), base seed drawn, then RandomSampler draws its
            # seed from the global RNG.  Same draws, but the seed is kept for replay.
            if not predrawn:
                self.base_seed = int(torch.empty((), dtype=torch.int64).random_().item())
            if "sampler_seed" not in replay:
                replay["sampler_seed"] = int(torch.empty((), dtype=torch.int64).random_().item())
            it = iter(self.index_sampler(epoch, replay["sampler_seed"]))
            return it, replay
        it = iter(self.index_sampler(epoch))
        if self.generator is not None or (self.seed is None and not self.sharded):
            # DataLoader draws its base seed here (from the global RNG without a
            # generator); with seed= the global RNG is left alone.
            self.base_seed = int(torch.empty((), dtype=torch.int64).random_(
                generator=self.generator).item())
        return it, replay

    def resharded(self, epoch: int, offset: int) -> Iterator[Any]:
        """This rank's batches for the rest of a sharded epoch of which the first
        ``offset`` positions of the global order were consumed (under any world
        size): the rest of the epoch split across the current ranks, each sample
        once, padded as ``DistributedSampler`` pads."""
        n = len(self.dataset)
        rest = epoch_order(n, epoch, self.seed or 0, self.shuffle)[min(offset, n):]
        mine = shard(rest, self.rank, self.world_size, self.drop_last) if rest else []
        if self.batch_size is None:
            return iter(mine)
        return iter(BatchSampler(mine, self.batch_size, self.drop_last))

    def __len__(self) -> int:
        return len(self.index_sampler(0))  # type: ignore[arg-type]
