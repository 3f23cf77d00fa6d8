"""The loader's resume state: one dataclass inside, a plain dict outside.

``LoaderState`` is what ``AsyncLoader.state_dict()`` describes and
``load_state_dict()`` reads back.  ``to_dict()`` gives the plain, versioned dict
users save (ints, strings, lists, bools, ``None``, plus whatever a dataset's or
sampler's own ``state_dict()`` returns: JSON and ``torch.save`` friendly when
theirs are); ``from_dict()`` reads it back, with the version checked.  Version 1
(written before the dataset's, sampler's and stream's own state were saved) is
still read: the fields it lacks take their defaults.

``PassProgress`` is the bookkeeping of one pass (which planned batches the
consumer took, what skip mode carried over): the iterator updates it, the loader
keeps it after the iterator is gone (a ``break``), so ``state_dict()`` still
says where that pass stopped until the next ``iter()``.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field, fields
from typing import Any

from .._errors import StateError

__all__ = ["FORMAT", "VERSION", "LoaderState", "PassProgress"]

FORMAT = "asyncfeed.AsyncLoader"
VERSION = 2
_READABLE = (1, 2)
# fields written since version 2 (a version-1 state lacks them)
_V2_FIELDS = ("stream", "dataset_state", "sampler_state")


@dataclass
class LoaderState:
    """Where a loader stands, and what it was configured with when the state was taken.

    The configuration fields (``dataset_len`` ... ``on_error``) are compared at
    ``load_state_dict``; the position fields say where the pass (``in_pass``) or
    the next pass stands.  See ``docs/distributed.md`` for each field.
    """

    epoch: int = 0
    dataset_len: int | None = None
    batch_size: int | None = 1
    drop_last: bool = False
    shuffle: bool = False
    seed: int | None = None
    world_size: int = 1
    rank: int = 0
    on_error: str = "raise"
    in_pass: bool = False
    batches_taken: int = 0
    taken_extra: list[int] = field(default_factory=list)
    offset: int = 0
    carry: list[Any] = field(default_factory=list)
    replay: dict[str, Any] = field(default_factory=dict)
    resharded_from: int | None = None
    # version 2
    stream: dict[str, Any] | None = None   # an IterableDataset pass: items taken, snapshot
    dataset_state: Any = None              # the dataset's own state_dict()
    sampler_state: Any = None              # the sampler's (or batch sampler's) own

    def to_dict(self) -> dict[str, Any]:
        """The plain dict ``state_dict()`` returns (a deep copy: later changes to the
        loader or to this object do not reach it)."""
        out: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        for f in fields(self):
            out[f.name] = copy.deepcopy(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, state: Any) -> LoaderState:
        """Read a dict written by ``to_dict`` (this version or an older one).

        Raises :class:`StateError` for anything else: not a dict, another format,
        an unknown version, a field of the wrong kind.
        """
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise StateError("not an asyncfeed AsyncLoader state")
        version = state.get("version")
        if version not in _READABLE:
            raise StateError(f"state version {version!r} is not supported (this asyncfeed "
                             f"reads versions {', '.join(map(str, _READABLE))} and writes "
                             f"version {VERSION})")
        known = {f.name for f in fields(cls)}
        if version == 1:
            known -= set(_V2_FIELDS)
        kw = {k: copy.deepcopy(v) for k, v in state.items() if k in known}
        if "epoch" not in kw:
            raise StateError("the state has no epoch")
        try:
            st = cls(**kw)
            st.epoch = int(st.epoch)
            st.batches_taken = int(st.batches_taken)
            st.offset = int(st.offset)
            st.taken_extra = [int(k) for k in st.taken_extra]
            st.carry = list(st.carry)
            st.replay = dict(st.replay or {})
            if st.resharded_from is not None:
                st.resharded_from = int(st.resharded_from)
        except (TypeError, ValueError) as e:
            raise StateError(f"a malformed asyncfeed state: {e}") from None
        return st


class PassProgress:
    """What the consumer has taken in one pass, kept after the pass's iterator is gone.

    Map-style passes count planned batches (ids from 0 in this pass, on top of
    ``base`` batches a resumed state had already taken); IterableDataset passes
    also record where each taken batch ends in the stream.  Updated by the
    consumer's thread; read by ``state_dict()`` from any thread (under ``lock``).
    """

    def __init__(self, epoch: int, replay: dict[str, Any] | None = None, base: int = 0,
                 offset: int = 0, extra: list[int] | None = None,
                 carry: list[Any] | None = None, resharded_from: int | None = None,
                 sampler_state: Any = None, stream_start: int = 0) -> None:
        # reentrant: a garbage collection inside a locked section may run the dropped
        # iterator's finalizer, which reads this record in the same thread
        self.lock = threading.RLock()
        self.epoch = epoch
        self.replay: dict[str, Any] = dict(replay or {})
        self.base = base
        self.offset0 = offset
        self.resharded_from = resharded_from
        self.taken: set[int] = {k - base for k in (extra or [])}
        self.prefix = 0                  # batches 0..prefix-1 of this pass all taken
        self.taken_samples = 0
        self.carry: list[Any] = list(carry or [])   # indices carried over (skip mode)
        self.done = False
        # a stateful sampler: its state after each number of planned batches drawn
        self.sampler_snaps: dict[int, Any] = {}
        self.sampler_state0 = sampler_state          # the state this pass resumed from
        # an IterableDataset pass: where each taken batch ends in the stream
        self.stream_start = stream_start
        self.stream_ends: dict[int, int] = {}
        self.stream: Any = None                      # the pass's StreamTracker

    def took(self, k: int, n: int, end: int | None = None) -> None:
        """The consumer took planned batch ``k`` of ``n`` samples (ending at stream
        position ``end`` for an iterable)."""
        with self.lock:
            self.taken.add(k)
            self.taken_samples += n
            if end is not None:
                self.stream_ends[k] = end
            if k != self.prefix:
                return
            while self.prefix in self.taken:
                self.prefix += 1
            # what a state can no longer need (a pass nobody asks the state of must
            # not grow a snapshot per batch)
            if self.sampler_snaps:
                drawn = self.base + self.prefix
                for d in [d for d in self.sampler_snaps if d < drawn]:
                    del self.sampler_snaps[d]
            if self.stream is not None:
                for j in [j for j in self.stream_ends if j < self.prefix - 1]:
                    del self.stream_ends[j]
                self.stream.prune(self._items())

    def set_carry(self, indices: list[Any]) -> None:
        with self.lock:
            self.carry = list(indices)

    def snap_sampler(self, drawn: int, state: Any) -> None:
        with self.lock:
            self.sampler_snaps[drawn] = copy.deepcopy(state)

    def _prefix(self) -> int:
        while self.prefix in self.taken:
            self.prefix += 1
        return self.prefix

    def _items(self) -> int:
        """Stream items used by the batches of the taken prefix (iterable passes)."""
        if not self.prefix:
            return self.stream_start
        return self.stream_ends.get(self.prefix - 1, self.stream_start)

    def fill(self, st: LoaderState, world_size: int) -> None:
        """Write this pass's position into ``st`` (a mid-pass state)."""
        with self.lock:
            prefix = self._prefix()
            st.in_pass = True
            st.epoch = self.epoch
            st.batches_taken = self.base + prefix
            st.taken_extra = sorted(self.base + k for k in self.taken if k > prefix)
            st.offset = self.offset0 + self.taken_samples * world_size
            st.carry = list(self.carry)
            st.replay = dict(self.replay)
            st.resharded_from = self.resharded_from
            if prefix:
                st.sampler_state = self.sampler_snaps.get(self.base + prefix)
            else:
                st.sampler_state = self.sampler_state0
            if self.stream is not None:
                if st.taken_extra:
                    raise StateError("a mid-pass state of an IterableDataset needs the "
                                     "batches taken in stream order (in_order=True): a "
                                     "later batch has overtaken an earlier one")
                st.stream = self.stream.state_at(self._items())
