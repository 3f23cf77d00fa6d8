"""Where an IterableDataset pass stands, and how to get back there.

A stream has no index: its position is the number of items pulled from it.  A
pass's iterator runs ahead of the consumer (prefetching), so the state of the
dataset *now* is not the state at the last batch handed out.  ``StreamTracker``
therefore snapshots the dataset's own ``state_dict()`` (and its iterator's,
when ``iter(dataset)`` returns an object with one) each time the pulling thread
starts a chunk, keyed by stream position; a loader state for position ``p``
keeps the latest snapshot at or before ``p``.  A resume loads that snapshot,
makes the iterator and pulls and drops the few items between the snapshot and
``p``.  A dataset without state is fast-forwarded from its start: the items
already handed out are pulled again and dropped, which is exact only when the
dataset yields the same items in the same order every time.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..protocols import Stateful

__all__ = ["StreamTracker", "has_state"]


_ATOMS = (int, float, str, bool, bytes, type(None))


def plain_copy(x: Any) -> Any:
    """A deep copy of ``x``, fast for the plain data states are made of (dicts, lists,
    tuples, numbers, strings): ``copy.deepcopy`` costs several times more there, and
    a stream is snapshotted at every chunk pulled."""
    t = type(x)
    if t in _ATOMS:
        return x
    if t is list:
        if all(type(v) in _ATOMS for v in x):
            return x.copy()
        return [plain_copy(v) for v in x]
    if t is dict:
        return {k: plain_copy(v) for k, v in x.items()}
    if t is tuple:
        return tuple(plain_copy(v) for v in x)
    return copy.deepcopy(x)


def has_state(obj: Any) -> bool:
    """Whether ``obj`` keeps its own resumable state (:class:`~asyncfeed.protocols.Stateful`)."""
    return isinstance(obj, Stateful)


class StreamTracker:
    """Opens one pass over an IterableDataset (resumed or not) and snapshots it.

    ``resume``: the ``stream`` entry of a loader state (``items`` pulled by the
    batches handed out; ``at``, ``dataset``, ``iter``: the snapshot taken at
    stream position ``at``; ``self_iter``: ``iter(dataset)`` was the dataset
    itself, whose state is then loaded after ``iter()``), or None for a pass
    from the start.
    """

    @staticmethod
    def restore_ended(make_iter: Callable[[], Iterator[Any]], ended: dict[str, Any]) -> None:
        """Load the ``ended`` entry of a state taken between passes (see :meth:`ended`)
        into a fresh iterator from ``make_iter``, and drop that iterator."""
        its = ended.get("iter")
        if its is None:
            return
        it = make_iter()
        if has_state(it):
            it.load_state_dict(copy.deepcopy(its))  # type: ignore[attr-defined]

    def __init__(self, dataset: Any, resume: dict[str, Any] | None = None) -> None:
        self.dataset = dataset
        self.resume = resume
        self._ds_state = has_state(dataset)
        self._it_state = False
        self._lock = threading.Lock()
        self._snaps: dict[int, tuple[Any, Any]] = {}
        self._self_iter = False   # iter(dataset) is the dataset
        self.start = 0

    def open(self, make_iter: Callable[[], Iterator[Any]]) -> tuple[Iterator[Any], int]:
        """The pass's iterator and its stream position (in the caller's thread).

        A resumed pass: the snapshot's dataset state is loaded before
        ``make_iter()`` and its iterator state after, then the items between the
        snapshot and the resume position are pulled and dropped (errors they
        raise included: they were counted the first time too).
        """
        r = self.resume
        items, at = 0, 0
        own = r is not None and r.get("dataset") is not None and self._ds_state
        self_iter = r is not None and bool(r.get("self_iter"))
        if r is not None:
            items = int(r.get("items", 0))
            at = int(r.get("at", 0))
            if own and not self_iter:
                self.dataset.load_state_dict(copy.deepcopy(r["dataset"]))
            elif not own and r.get("iter") is None:
                at = 0   # no snapshot: fast-forward from the start
        it = make_iter()
        self._self_iter = it is self.dataset
        if own and self_iter:
            # a dataset that is its own iterator sets itself up in __iter__: its
            # state goes in after (as StatefulDataLoader loads an iterator's state)
            self.dataset.load_state_dict(copy.deepcopy(r["dataset"]))  # type: ignore[index]
        self._it_state = it is not self.dataset and has_state(it)
        if r is not None and r.get("iter") is not None:
            if self._it_state:
                it.load_state_dict(copy.deepcopy(r["iter"]))  # type: ignore[attr-defined]
            elif r.get("dataset") is None:
                at = 0
        for _ in range(max(0, items - at)):
            try:
                next(it)
            except StopIteration:
                break
            except Exception:  # noqa: BLE001 - an item that failed before fails again
                pass
        self.start = items
        self.mark(items, it)
        return it, items

    @property
    def stateful(self) -> bool:
        return self._ds_state or self._it_state

    def mark(self, position: int, it: Iterator[Any]) -> None:
        """Snapshot the stream at ``position`` (the pulling thread, between chunks)."""
        if not self.stateful:
            return
        ds = plain_copy(self.dataset.state_dict()) if self._ds_state else None
        its = plain_copy(it.state_dict()) if self._it_state else None  # type: ignore[attr-defined]
        with self._lock:
            self._snaps[position] = (ds, its)

    def prune(self, items: int) -> None:
        """Drop the snapshots no state for position ``items`` or later can use."""
        with self._lock:
            below = [p for p in self._snaps if p <= items]
            if below:
                at = max(below)
                for p in below:
                    if p < at:
                        del self._snaps[p]

    def ended(self) -> dict[str, Any] | None:
        """The ``stream`` entry of a state taken after the pass ended: the iterator's
        state where the stream ended (None without one).  A resume loads it into a
        fresh iterator and drops that iterator (the next pass starts from the
        beginning), so what the iterator's state restores besides its position (a
        random generator it draws from) is where the ended pass left it, as
        StatefulDataLoader restores it."""
        with self._lock:
            if not self._it_state or not self._snaps:
                return None
            _, its = self._snaps[max(self._snaps)]
        return {"ended": True, "iter": plain_copy(its)}

    def state_at(self, items: int) -> dict[str, Any]:
        """The ``stream`` entry of a state for a pass whose batches handed out end at
        stream position ``items``."""
        self.prune(items)
        with self._lock:
            below = [p for p in self._snaps if p <= items]
            if not below:
                return {"items": items, "at": 0, "dataset": None, "iter": None}
            at = max(below)
            ds, its = self._snaps[at]
        return {"items": items, "at": at, "dataset": plain_copy(ds), "iter": plain_copy(its),
                "self_iter": self._self_iter}
