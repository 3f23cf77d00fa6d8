"""What one pass's iterator needs from its loader, handed over as data.

The loader builds a :class:`PassContext` at each ``iter()``; the iterator reads
its settings from it and records into the loader's counters and skip log
through it.  It holds no reference to the loader, so a dropped loader can be
collected while an iterator of it lives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._memory.hostpool import HostBufferPool
from .config import OnError
from .samples import LayoutHolder
from .plan import IndexPlan
from .skips import SkipLog
from .stats import LoaderStats


def batch_count(dataset: Any, plan: IndexPlan, iterable: bool, batch_size: int | None,
                drop_last: bool) -> int:
    """Batches in a pass (``len(loader)``); ``TypeError`` for an iterable dataset
    without a length, as DataLoader."""
    if iterable:
        n = len(dataset)
        if batch_size is not None:
            n = n // batch_size if drop_last else math.ceil(n / batch_size)
        return n
    return len(plan)


@dataclass(frozen=True)
class PassContext:
    """A pass's settings (the loader's, as they were at ``iter()``) and the
    loader-owned parts the pass records into.

    ``stats``: the loader's live counters (waits, batches, samples, path);
    ``skips``: its skip log; ``host_pool``: the batch memory the pass trims and
    clears; ``layouts``: the sample layout learnt so far; ``plan`` and
    ``generator``: to rewind a user's generator when the pass is cut short;
    ``length``: the batches in a pass (``len()``); ``owner``: the loader, kept
    alive by the pass's iterator (a loader collected closes its pass).
    """

    dataset: Any
    batch_size: int | None
    drop_last: bool
    timeout: float
    in_order: bool
    on_error: OnError
    iterable: bool
    epoch: int
    plan: IndexPlan
    generator: torch.Generator | None
    stats: LoaderStats
    skips: SkipLog
    host_pool: HostBufferPool
    layouts: LayoutHolder
    length: Callable[[], int]
    owner: object
