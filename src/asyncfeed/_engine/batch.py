"""A planned batch and what its samples produced: the record every stage of a
pass reads and writes (plan -> fetch -> rows -> assemble -> transfer -> hand-off).

A :class:`Batch` is made by the plan stage (``Pipeline.top_up``, or the iterable
pass), filled row by row by whichever executor loads its samples, assembled and
copied by the thread that completes it, and handed to the consumer.  Its
:class:`BatchMode` says how its rows are kept and assembled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .._errors import SampleError, is_fatal, rebuild_error
from .._memory.layout import Layout
from .._memory.slots import Slot
from ..protocols import NamedSamples

__all__ = ["NO_RAW", "WRITTEN", "Batch", "BatchMode", "sample_error", "sample_source"]


class BatchMode(str, enum.Enum):
    """How a batch's samples become the batch."""

    RING = "ring"         # rows written into host buffers (or a slot) of the known layout
    COLLATE = "collate"   # samples kept in a list, collated when the batch is complete
    BATCH = "batch"       # the dataset's ``__getitems__`` loads the whole batch at once
    PLAN = "plan"         # the sampler failed: the batch only carries that error


class _Marker:
    """A named sentinel (its repr is its name)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: what ``Batch.samples`` holds for a ring row written into the batch's buffers and
#: let go of (by this process, or by a worker process into shared memory, its
#: sample never coming here): read back from the row (:func:`~.samples.restored`)
#: when the batch must be collated after all
WRITTEN: Any = _Marker("WRITTEN")

#: the ``raw`` of a sample that was not fetched on the event loop: the decode
#: thread reads it itself (``read``), or calls ``__getitem__``
NO_RAW: Any = _Marker("NO_RAW")


@dataclass(eq=False, slots=True)
class Batch:
    """A planned batch and everything its samples produced.

    Written by the threads that load its rows (``samples``, ``done``,
    ``failures`` under the pass's lock), then by the thread that completes it
    (``output``, ``event``, ``error``); read by the consumer once it is ready.
    Compared by identity."""

    k: int                       # its number in the pass
    indices: list[Any]           # the dataset indices of its rows
    mode: BatchMode
    n: int = field(init=False)
    bufs: list[Any] | None = field(default=None, repr=False)  # host buffers (ring)
    slot: Slot | None = field(default=None, repr=False)       # its slot of the ring, if any
    samples: list[Any] = field(init=False, repr=False)
    remaining: int = field(init=False)  # rows not yet reported done
    done: bytearray = field(init=False, repr=False)
    # (row, index, error); the error is dropped (None) once the consumer recorded it
    failures: list[tuple[int, Any, BaseException | None]] = field(default_factory=list)
    error: BaseException | None = None   # a batch-level error (collate_fn...)
    output: Any = field(default=None, repr=False)
    event: Any = field(default=None, repr=False)
    good_samples_host: list[tuple[Any, Any]] = field(default_factory=list, repr=False)
    mismatch: bool = False     # a row did not fit the layout: the batch is collated
    layout: Layout | None = field(default=None, repr=False)
    views: list[Any] | None = field(default=None, repr=False)  # NumPy views of bufs
    t_ready: float = 0.0       # perf_counter() when it became ready
    deferred: bool = False     # rows loaded but not written: its completion writes them
    collated: Any = field(default=None, repr=False)  # collated by a worker process

    def __post_init__(self) -> None:
        if type(self.mode) is not BatchMode:  # (a plain string; the enum's call costs
            self.mode = BatchMode(self.mode)  # a microsecond, once per batch)
        self.n = len(self.indices)
        self.samples = [None] * self.n
        self.remaining = self.n
        self.done = bytearray(self.n)

    def pending(self) -> list[Any]:
        """The indices of the rows not yet reported done."""
        return [i for r, i in enumerate(self.indices) if not self.done[r]]


def sample_source(dataset: Any, idx: Any) -> str | None:
    """The path or URL the dataset names for ``idx`` (None when it cannot)."""
    if isinstance(dataset, NamedSamples):
        try:
            return dataset.sample_source(idx)
        except Exception:  # noqa: BLE001 - a name is a courtesy, not a requirement
            return None
    return None


def sample_error(dataset: Any, idx: Any, e: BaseException, batch: int | None) -> BaseException:
    """What the consumer raises for sample ``idx``'s error ``e``: an exception of
    ``e``'s type that is also a :class:`SampleError` naming the sample (see
    ``rebuild_error``); KeyboardInterrupt and SystemExit as they are."""
    if is_fatal(e) or isinstance(e, SampleError):
        return rebuild_error(e, idx, None, batch)
    return rebuild_error(e, idx, sample_source(dataset, idx), batch)
